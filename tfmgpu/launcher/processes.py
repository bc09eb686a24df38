"""One task of a local cluster as a process group: start, signal, reap.

Each task is the leader of its own process group (a new session), so a
signal to the task reaches its children too, and a Ctrl-C in the terminal
reaches only the launcher. A task's stdout and stderr are merged and copied
line by line, each line after a `[worker:0] ` prefix. POSIX only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Callable


def describe_exit(code: int | None) -> str:
  """`"exited with code 3"`, `"was killed by signal SIGKILL (9)"`, ..."""
  if code is None:
    return "is still running"
  if code >= 0:
    return f"exited with code {code}"
  try:
    name = signal.Signals(-code).name
  except ValueError:
    name = "unknown"
  return f"was killed by signal {name} ({-code})"


def group_has_live_process(pgid: int) -> bool:
  """Whether process group `pgid` has a process that is not a zombie."""
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  if not os.path.isdir("/proc"):
    return True
  # killpg also succeeds for zombies, which orphans become when nothing reaps
  # them (e.g. in containers); they hold no resources, so skip them.
  for entry in os.scandir("/proc"):
    if not entry.name.isdigit():
      continue
    try:
      with open(f"/proc/{entry.name}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    state, _, pgrp = stat[stat.rfind(b")") + 2:].split()[:3]
    if int(pgrp) == pgid and state not in (b"Z", b"X"):
      return True
  return False


def _pump(stream, prefix: str, write: Callable[[str], None]) -> None:
  """Copies `stream` to `write` line by line, each line after `prefix`."""
  with stream:
    for raw in iter(stream.readline, b""):
      write(prefix + raw.decode("utf-8", "replace").rstrip("\r\n") + "\n")


class Task:
  """One started task: its process, output reader and bookkeeping.

  Attributes:
    name: e.g. `"worker:0"`.
    type: the task type, e.g. `"worker"`.
    proc: the task's process, leader of its own process group.
    reader: the thread copying the task's output.
    stopped: whether the launcher signalled it while it ran.
  """

  def __init__(self, name: str, task_type: str, proc: subprocess.Popen,
               reader: threading.Thread):
    self.name, self.type, self.proc, self.reader = name, task_type, proc, reader
    self.stopped = False
    self._group_gone = False

  @classmethod
  def start(cls, name: str, task_type: str, command: Sequence[str],
            env: Mapping[str, str], write: Callable[[str], None]) -> Task:
    """Starts `command` in a new session; its output goes to `write`."""
    proc = subprocess.Popen(
        list(command), env=dict(env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    reader = threading.Thread(
        target=_pump, args=(proc.stdout, f"[{name}] ", write),
        name=f"tfmgpu-launcher-{name}", daemon=True)
    task = cls(name, task_type, proc, reader)
    try:
      reader.start()
    except BaseException:  # Not yet recorded anywhere: stop it here.
      task.signal(signal.SIGKILL)
      raise
    return task

  def running(self) -> bool:
    return self.proc.poll() is None

  def alive(self) -> bool:
    """Whether the task or anything left in its process group still runs."""
    if self.running():
      return True
    if not self._group_gone:
      self._group_gone = not group_has_live_process(self.proc.pid)
    return not self._group_gone

  def signal(self, sig: int) -> None:
    """Sends `sig` to the task's whole process group, if any of it is left."""
    if self._group_gone:
      return
    try:
      os.killpg(self.proc.pid, sig)
    except ProcessLookupError:
      self._group_gone = self.proc.poll() is not None
    except PermissionError:
      pass


def names(tasks: Sequence[Task]) -> str:
  """`"worker:0, worker:1"` for messages."""
  return ", ".join(t.name for t in tasks)
