"""The ports a cluster's tasks listen on: the address family and the error.

The launcher picks or checks ports for local tasks, and the cluster preflight
checks this task's own port before training; both bind the way TensorFlow's
gRPC server listens (on all interfaces) and fail with `PortInUseError`.
`wait_until_listening` gives other tasks a bounded time to come up (a
parameter-server coordinator would otherwise wait forever for a dead one).
"""

from __future__ import annotations

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


def wait_until_listening(tasks: Mapping[str, str], timeout_s: float, *,
                         poll_s: float = 0.5,
                         log: Callable[[str], None] | None = None
                         ) -> dict[str, str]:
  """Waits until every task's address accepts a TCP connection.

  Args:
    tasks: task name (`"worker:1"`) -> its `host:port`.
    timeout_s: how long to wait at most.
    poll_s: seconds between tries.
    log: called now and then with a line naming the tasks still awaited.

  Returns:
    The tasks that never listened, with why (`{}`: every task listens).
  """
  deadline = time.monotonic() + timeout_s
  waiting = dict(tasks)
  next_log = time.monotonic() + 10.0
  while True:
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
                      log: Callable[[str], None] | None = None) -> None:
  """Every task listens within `timeout_s`, or an error: TensorFlow's
  connect waits forever for a task that died before it.

  Args:
    tasks: task name (`"worker:1"`) -> its `host:port`.
    timeout_s: how long to wait at most.
    who: the run that waits, for the message (e.g. "parameter_server").
    waiter: the task that waits, for the message ("the coordinator").
    log: as for `wait_until_listening`.

  Raises:
    RuntimeError: tasks that did not listen in time (named, with why).
  """
  missing = wait_until_listening(tasks, timeout_s, log=log)
  if missing:
    named = ", ".join(f"{name} ({tasks[name]}: {why})"
                      for name, why in missing.items())
    raise RuntimeError(
        f"{who}: {named} did not come up within connect_timeout_s="
        f"{timeout_s:g} s, so {waiter} stops instead of waiting forever for "
        "it. Check that task's log (it may have died), then run the job "
        "again; --connect_timeout_s sets the wait.")
