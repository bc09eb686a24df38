"""Why a launcher stops its tasks: a one-line note each task can read.

`python -m tfmgpu.launch` stops the other tasks with SIGTERM when one
fails, when its timeout passes or when it is signalled itself. SIGTERM
carries no reason, so a task that only saw it said "SIGTERM received", as
for a scheduler's preemption notice, while the peer it waits for was
already gone. The launcher gives every task the path of a note (in the
environment, `NOTE_ENV`) and writes the reason there before it signals;
the task's SIGTERM handler (`tfmgpu.training.preemption`) and its error
for a lost peer (`tfmgpu.training.lost_tasks`) read it.

Imports nothing heavy: the launcher must not load TensorFlow.
"""

from __future__ import annotations

import os
import tempfile
import uuid

NOTE_ENV = "TFMGPU_STOP_NOTE"


def new_path() -> str:
  """A path for one launch's note (the file is made only when written)."""
  return os.path.join(tempfile.gettempdir(),
                      f"tfmgpu-stop-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write(path: str, reason: str) -> None:
  """Writes `reason` (e.g. `"worker:1 exited with code 1"`) whole, by a
  rename; best effort: a note that cannot be written is skipped."""
  aside = f"{path}.{os.getpid()}.tmp"
  try:
    with open(aside, "w", encoding="utf-8") as f:
      f.write(reason)
    os.replace(aside, path)
  except OSError:
    remove(aside)


def read() -> str | None:
  """The note of the launcher that started this process, if it wrote one."""
  path = os.environ.get(NOTE_ENV)
  if not path:
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().strip() or None
  except OSError:
    return None


def remove(path: str) -> None:
  """Deletes a launch's note (when its tasks are gone); never raises."""
  try:
    os.remove(path)
  except OSError:
    pass
