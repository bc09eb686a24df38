"""The ports a cluster's tasks listen on: the address family and the error.

The launcher picks or checks ports for local tasks, and the cluster preflight
checks this task's own port before training; both bind the way TensorFlow's
gRPC server listens (on all interfaces) and fail with `PortInUseError`.
`wait_until_listening` gives other tasks a bounded time to come up (a
parameter-server coordinator would otherwise wait forever for a dead one).
Tasks that wait for each other before any of them starts TensorFlow (the
workers of `multi_worker_mirrored`) each hold their own port open meanwhile
(`Announcement`), so that every one of them sees the others.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Mapping
from typing import Callable


class PortInUseError(ValueError):
  """A port the cluster needs cannot be bound on this machine."""


def address_family(host: str) -> socket.AddressFamily:
  """`AF_INET6` for an IPv6 host (`"::1"`, `"[::1]"`), else `AF_INET`."""
  return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def _listening(address: str) -> str | None:
  """`None` if `host:port` accepts a TCP connection, else why not."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  try:
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
      s.settimeout(2.0)
      s.connect((host, int(port)))
  except (OSError, ValueError) as e:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
  return None


class Announcement:
  """This task's port, accepting (and at once closing) connections until
  closed: peers that wait for it to listen see it before it starts
  TensorFlow, whose server then takes the port over (both reuse it like
  gRPC). A port that cannot be bound (TensorFlow's server already holds it)
  announces nothing: the server answers for it.

  Args:
    address: this task's `host:port`.
  """

  def __init__(self, address: str):
    host, _, port = address.rpartition(":")
    self._sock: socket.socket | None = socket.socket(
        address_family(host.strip("[]")), socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self._sock.bind(("", int(port)))
      self._sock.listen(64)
      self._sock.setblocking(False)
    except (OSError, ValueError):
      self.close()

  def answer(self) -> None:
    """Closes the connections peers opened to check that it listens."""
    while self._sock is not None:
      try:
        conn, _ = self._sock.accept()
      except OSError:
        return
      conn.close()

  def close(self) -> None:
    if self._sock is not None:
      self._sock.close()
      self._sock = None


def wait_until_listening(tasks: Mapping[str, str], timeout_s: float, *,
                         poll_s: float = 0.5,
                         log: Callable[[str], None] | None = None,
                         between: Callable[[], None] | None = None
                         ) -> dict[str, str]:
  """Waits until every task's address accepts a TCP connection.

  Args:
    tasks: task name (`"worker:1"`) -> its `host:port`.
    timeout_s: how long to wait at most.
    poll_s: seconds between tries.
    log: called now and then with a line naming the tasks still awaited.
    between: called before every try (`Announcement.answer`).

  Returns:
    The tasks that never listened, with why (`{}`: every task listens).
  """
  deadline = time.monotonic() + timeout_s
  waiting = dict(tasks)
  next_log = time.monotonic() + 10.0
  while True:
    if between is not None:
      between()
    waiting = {name: why for name, why in (
        (name, _listening(tasks[name])) for name in waiting) if why}
    now = time.monotonic()
    if not waiting or now >= deadline:
      return waiting
    if log and now >= next_log:
      log(f"Waiting for {', '.join(waiting)} to listen "
          f"({timeout_s - (deadline - now):.0f} s of {timeout_s:g} s).")
      next_log = now + 30.0
    time.sleep(min(poll_s, max(deadline - now, 0.0)))


def require_listening(tasks: Mapping[str, str], timeout_s: float, *,
                      who: str,
                      waiter: str = "this task",
                      log: Callable[[str], None] | None = None,
                      listen_on: str | None = None) -> None:
  """Every task listens within `timeout_s`, or an error: TensorFlow's
  connect waits forever for a task that died before it.

  Args:
    tasks: task name (`"worker:1"`) -> its `host:port`.
    timeout_s: how long to wait at most.
    who: the run that waits, for the message (e.g. "parameter_server").
    waiter: the task that waits, for the message ("the coordinator").
    log: as for `wait_until_listening`.
    listen_on: this task's own `host:port`, held open while it waits
      (`Announcement`) for tasks that wait for it in turn.

  Raises:
    RuntimeError: tasks that did not listen in time (named, with why).
  """
  announced = Announcement(listen_on) if listen_on else None
  with contextlib.closing(announced) if announced else contextlib.nullcontext():
    missing = wait_until_listening(
        tasks, timeout_s, log=log,
        between=announced.answer if announced else None)
  if missing:
    named = ", ".join(f"{name} ({tasks[name]}: {why})"
                      for name, why in missing.items())
    raise RuntimeError(
        f"{who}: {named} did not come up within connect_timeout_s="
        f"{timeout_s:g} s, so {waiter} stops instead of waiting forever for "
        "it. Check that the task was started with this address and that its "
        "log shows no error (it may have died), then run the job again; "
        "--connect_timeout_s sets the wait.")
