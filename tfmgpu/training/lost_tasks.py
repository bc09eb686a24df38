"""A task of the cluster lost while training: said in one line.

When a peer worker of a multi-worker mirrored run dies, the survivors'
next collective fails, after TF's heartbeat timeout, with an
`UnavailableError` of some 50 lines ("The following tasks are unhealthy
(stopped sending heartbeats)"); when a parameter server dies, the
coordinator's join raises one full of gRPC details. `lost_task_error`
turns it into a `LostTaskError` naming the task (as TF names it, else as
the launcher's note says, `tfmgpu.stop_notes`), the last checkpoint kept,
and that the same command resumes from it.
"""

from __future__ import annotations

import re

from tfmgpu import stop_notes
from tfmgpu.training import checkpoints as ckpt_lib

_TASK = r"/job:(\w+)/replica:\d+/task:(\d+)"
# TF's coordination service: "The following tasks are unhealthy (stopped
# sending heartbeats):\n/job:worker/replica:0/task:1\n..."
_UNHEALTHY = re.compile(r"unhealthy[^\n]*:\s*((?:" + _TASK + r"\s*)+)")
# A parameter server a gRPC call failed on ("remote target /job:ps/...").
_PS_TARGET = re.compile(r"remote target /job:(ps)/replica:\d+/task:(\d+)")


class LostTaskError(RuntimeError):
  """Training stopped because another task of the cluster stopped
  responding (a peer worker, a parameter server); the checkpoints are kept.
  """


def lost_tasks(message: str) -> list[str]:
  """The tasks TF's error `message` says are lost (`["worker:1"]`), else
  `[]`: those its coordination service found unhealthy, else the
  parameter servers its gRPC calls failed on (a worker it names there only
  passed the error on)."""
  unhealthy = _UNHEALTHY.search(message)
  found = (re.findall(_TASK, unhealthy.group(1)) if unhealthy
           else _PS_TARGET.findall(message))
  return list(dict.fromkeys(f"{job}:{index}" for job, index in found))


def lost_task_error(message: str, checkpointer: ckpt_lib.Checkpointer | None
                    ) -> LostTaskError:
  """The one-line error for TF's `UnavailableError` (its `message`) in a
  cluster run whose checkpoints are `checkpointer`'s."""
  named = lost_tasks(message)
  note = stop_notes.read()
  if named:
    who = f"{' and '.join(named)} stopped responding" + (
        f" (the launcher: {note})" if note else "")
  elif note:
    who = f"A task of the cluster stopped responding (the launcher: {note})"
  else:
    who = "A peer worker or parameter server stopped responding"
  latest = checkpointer.latest if checkpointer is not None else None
  if latest:
    kept = (f"The last checkpoint kept is {latest} "
            f"({ckpt_lib.describe_position(checkpointer.progress)}): run the "
            "same command again to resume from it")
  else:
    kept = ("No checkpoint was saved yet: run the same command again to "
            "start over")
  return LostTaskError(f"{who}, and training cannot go on without it. "
                       f"{kept}.")
