"""Measurements taken in a fresh Python process.

The bench splits the CPU into logical devices and gives each op one thread
(`devices.configure_virtual_devices`); a single-device run as a user makes
it gets every core per op. TensorFlow fixes its threads when it starts, so
single-device figures (the compute ceiling, the language model on one
device) are measured in a child process that keeps TensorFlow's defaults,
while the bench's own process waits.

A run that needs several such measurements starts one child for them all
(`shared_process`) before it imports TensorFlow itself, so the two imports
run side by side on two cores and none is paid again; `call_in_child`
then runs each measurement there, one at a time. Without a shared child
each call starts a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

_MARK = "TFMGPU_CHILD_JSON "
_READY = "TFMGPU_CHILD_READY"
_FAILED = "TFMGPU_CHILD_FAILED"

_CHILD = f"""
import importlib, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)(
    **json.loads(sys.argv[2]))
print({_MARK!r} + json.dumps(result))
"""


# The shared child imports the modules named by its arguments, then serves
# one call per line of its stdin: `[module, name, kwargs]`. It answers on a
# line of its own (after whatever the call printed) with _MARK + the JSON
# `[result, its CPU seconds so far]`, or _FAILED after the traceback on its
# stderr, and clears Keras' session (when loaded) between calls.
_SERVER = f"""
import importlib, json, os, sys, time, traceback
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
for module in sys.argv[1:]:
  importlib.import_module(module)
print({_READY!r}, flush=True)
for line in sys.stdin:
  module, name, kwargs = json.loads(line)
  try:
    result = getattr(importlib.import_module(module), name)(**kwargs)
    answer = json.dumps([result, time.process_time()])
  except Exception:
    traceback.print_exc()
    sys.stderr.flush()
    print("\\n" + {_FAILED!r}, flush=True)
    continue
  finally:
    if "keras" in sys.modules:
      sys.modules["keras"].backend.clear_session()
  print("\\n" + {_MARK!r} + answer, flush=True)
"""


class SharedProcess:
  """One child process that serves `call_in_child` calls in turn.

  It starts at once, importing `preload` (TensorFlow and Keras); the
  caller's `wait_ready` blocks until it has, so that nothing the caller
  times shares the cores with the import. `cpu_seconds`: the child's CPU
  time at its last answer.
  """

  def __init__(self, preload: tuple[str, ...] = ("tensorflow", "keras")
               ) -> None:
    self._stderr = tempfile.TemporaryFile()
    self._proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=self._stderr, text=True)
    self._lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    self._ready, self._exited, self._tail = False, False, ""
    self.cpu_seconds = 0.0

  def _read(self) -> None:
    for line in self._proc.stdout:
      self._lines.put(line.rstrip("\n"))
    self._lines.put(None)  # The child has exited.

  def _next(self, expected: tuple[str, ...], timeout_s: float) -> str | None:
    """The next protocol line (starting with one of `expected`); None when
    the child exited; `TimeoutError` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not self._exited:
      try:
        line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
      except queue.Empty as e:
        raise TimeoutError from e
      self._exited = line is None
      if line is not None and line.startswith(expected):
        return line
    return None

  def _stderr_tail(self) -> str:
    """The end of the child's stderr (read without moving the file's
    offset, which the child shares); the last one read once closed."""
    if not self._stderr.closed:
      size = os.fstat(self._stderr.fileno()).st_size
      self._tail = os.pread(self._stderr.fileno(), 2000,
                            max(size - 2000, 0)).decode(errors="replace")
    return self._tail

  def _failure(self, what: str, alone: str, why: str, *,
               stop: bool = True) -> RuntimeError:
    """The error naming `what` failed, `why`, the command to run `alone`
    and the end of the child's stderr; `stop`: the child is stopped first
    (it exited or hangs)."""
    if stop:
      self.close()
    return RuntimeError(f"{what} process {why}; run `{alone}` alone to see "
                        f"why. Its stderr ends: {self._stderr_tail()}")

  def wait_ready(self, timeout_s: int = 300) -> None:
    """Blocks until the child has imported its `preload` modules.

    Raises:
      RuntimeError: it exited or took over `timeout_s` seconds first.
    """
    if self._ready:
      return
    try:
      self._ready = self._next((_READY,), timeout_s) is not None
    except TimeoutError:
      raise self._failure("the bench's child", "python -c 'import "
                          "tensorflow'", f"took over {timeout_s} s to "
                          "start") from None
    if not self._ready:
      raise self._failure("the bench's child", "python -c 'import "
                          "tensorflow'", f"exited ({self._proc.wait()}) "
                          "while starting")

  def call(self, function: str, kwargs: dict[str, Any], *, timeout_s: int,
           what: str, alone: str) -> Any:
    """`function(**kwargs)` in the child: `call_in_child`'s contract."""
    self.wait_ready()
    module, name = function.split(":")
    try:
      self._proc.stdin.write(json.dumps([module, name, kwargs]) + "\n")
      self._proc.stdin.flush()
      line = self._next((_MARK, _FAILED), timeout_s)
    except TimeoutError:
      self._proc.kill()  # It hangs, or works on past its time.
      raise self._failure(what, alone, f"took over {timeout_s} s") from None
    except (OSError, ValueError):  # Its stdin is closed: it has exited.
      line = None
    if line is None:
      raise self._failure(what, alone, f"failed (exit {self._proc.wait()})")
    if line.startswith(_FAILED):
      raise self._failure(what, alone, "failed", stop=False)
    result, self.cpu_seconds = json.loads(line[len(_MARK):])
    return result

  def close(self) -> None:
    """Stops the child: at once if it is still starting, else when its
    stdin closes (killed after 30 s, or if interrupted meanwhile)."""
    if self._proc.poll() is None:
      try:
        if not self._ready:
          self._proc.terminate()
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        pass
      finally:  # Killed if it has not ended (or Ctrl-C came meanwhile).
        if self._proc.poll() is None:
          self._proc.kill()
          self._proc.wait()
    self._stderr_tail()
    self._stderr.close()


_shared: SharedProcess | None = None


@contextlib.contextmanager
def shared_process(start: bool = True, **kwargs: Any
                   ) -> Iterator[SharedProcess | None]:
  """Within: `call_in_child` runs in one child process, started now
  (`kwargs` go to `SharedProcess`).

  Start it before the caller imports TensorFlow (the imports then run side
  by side); `wait_ready` before timing anything. `start=False`: no shared
  child (each call starts its own).
  """
  global _shared
  if not start or _shared is not None:
    yield _shared
    return
  _shared = SharedProcess(**kwargs)
  try:
    yield _shared
  finally:
    _shared.close()
    _shared = None


def wait_ready() -> None:
  """Blocks until the shared child (if one runs) has imported TensorFlow."""
  if _shared is not None:
    _shared.wait_ready()


def shared_cpu_seconds() -> float:
  """The shared child's CPU seconds at its last answer (0 without one):
  `os.times()` counts a child only once it has exited."""
  return _shared.cpu_seconds if _shared is not None else 0.0


def call_in_child(function: str, kwargs: dict[str, Any], *, timeout_s: int,
                  what: str, alone: str) -> Any:
  """`function(**kwargs)` in the shared child (`shared_process`), else in
  a fresh process; its JSON-ready result.

  Args:
    function: `"module:name"`, e.g. `"tfmgpu.benchmarks.ceiling:measure"`.
    kwargs: JSON-ready keyword arguments.
    timeout_s: the longest the child may take.
    what: what the child measures, for the errors ("the ceiling
      measurement").
    alone: the command that measures the same thing alone, which the
      errors suggest.

  Raises:
    RuntimeError: the child failed (with the end of its stderr) or took
      over `timeout_s` seconds.
  """
  if _shared is not None:
    return _shared.call(function, kwargs, timeout_s=timeout_s, what=what,
                        alone=alone)
  try:
    out = subprocess.run([sys.executable, "-c", _CHILD, function,
                          json.dumps(kwargs)], capture_output=True, text=True,
                         timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"{what} process took over {timeout_s} s; run "
                       f"`{alone}` alone to see why.") from e
  for line in out.stdout.splitlines():
    if line.startswith(_MARK):
      return json.loads(line[len(_MARK):])
  raise RuntimeError(f"{what} process failed (exit {out.returncode}); run "
                     f"`{alone}` alone to see why. Its stderr ends: "
                     f"{out.stderr[-2000:]}")
