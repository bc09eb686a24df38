"""`tfmgpu.ports`: tasks that wait for each other before any starts TF."""

import socket
import threading
import time

import pytest

from tfmgpu import ports


def _free_address() -> str:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{sock.getsockname()[1]}"


def _serve(address: str) -> socket.socket:
  """Listens on `address` as TF's server does once a task goes on."""
  sock = socket.socket()
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind(("", int(address.rpartition(":")[2])))
  sock.listen()
  return sock


def test_tasks_that_wait_for_each_other_see_each_other():
  """Each holds its own port open while it waits (the workers of
  multi_worker_mirrored, before TF's servers listen), then hands it to its
  server (bound again here): both go on, the later one at once."""
  a, b = _free_address(), _free_address()
  errors, servers, seconds = [], [], {}

  def wait(own, peer, name):
    start = time.monotonic()
    try:
      ports.require_listening({name: peer}, 20, who="test", listen_on=own)
      servers.append(_serve(own))
    except (RuntimeError, OSError) as e:  # The failure, shown below.
      errors.append(e)
    seconds[name] = time.monotonic() - start

  threads = [threading.Thread(target=wait, args=(a, b, "worker:1")),
             threading.Thread(target=wait, args=(b, a, "worker:0"))]
  threads[0].start()
  time.sleep(1.5)  # One starts later, as hand-started workers do.
  threads[1].start()
  for thread in threads:
    thread.join(30)
  for server in servers:
    server.close()
  assert not errors, errors
  assert seconds["worker:1"] < 4 and seconds["worker:0"] < 1, seconds


def test_a_task_that_never_listens_is_named_with_the_timeout():
  own, dead = _free_address(), _free_address()
  with pytest.raises(RuntimeError, match=(
      rf"test: worker:1 \({dead}: Connection refused\) did not come up "
      r"within connect_timeout_s=0.5 s, so this task stops")):
    ports.require_listening({"worker:1": dead}, 0.5, who="test",
                            listen_on=own)
