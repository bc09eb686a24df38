"""One client drives every task's devices: `multi_worker_mirrored
--zero_stage=N` across workers.

Under ZeRO each weight and optimizer slot lives on one device, its owner
(`tfmgpu.parallel.zero.ShardedModel`). Across workers that device may be in
another process, so tfmgpu runs sharded data parallelism *in-graph*: the
chief (the task that writes the outputs) connects to the cluster
(`tf.config.experimental_connect_to_cluster`) and trains one
`ShardedModel` whose replica devices are every task's GPUs, else each
task's CPU:0 (as `MultiWorkerMirroredStrategy` uses them). Every other task
only serves (`serve`): TF runs the chief's ops on its devices, and its
weights and slots stay in its process. TF's collectives cannot do this:
`MultiWorkerMirroredStrategy` keeps a whole copy on every worker, and TF
2.21 has no ring reduce-scatter on CPU (`parallel.zero_collectives`).

A serving task and the chief talk through two small files in the serving
task's own directory (a fresh temporary directory it works in), which the
chief reads and writes with ops placed on that task's CPU, so no shared
file system is needed:

- `tfmgpu-sigterm`: the task received SIGTERM (a preemption notice). It
  keeps serving; the chief, which checks every `CHECK_EVERY_S` at a step
  boundary, saves a checkpoint (its variables are still alive) and stops
  with exit code 42 (`preempted_task`).
- `tfmgpu-exit`: the chief's exit code and last message (`release`). The
  task prints the message and exits with that code. A chief that dies
  without writing it is noticed by its port closing: the task then exits 1.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from absl import logging

from tfmgpu import ports

SIGTERM_FILE = "tfmgpu-sigterm"
EXIT_FILE = "tfmgpu-exit"
CHECK_EVERY_S = 0.5  # The chief reads the serving tasks' SIGTERM files.
_POLL_S = 0.2  # A serving task looks for its exit file.
_CHIEF_POLL_S = 2.0  # ... and whether the chief still listens.
_END = "\n--\n"  # Ends the exit file: it was written whole.
JOBS = ("chief", "worker")


def client_task(cluster: dict[str, list[str]]) -> str:
  """The task that drives the others: `"chief:0"`, else `"worker:0"`."""
  return "chief:0" if cluster.get("chief") else "worker:0"


def tasks_of(cluster: dict[str, list[str]]) -> list[str]:
  """Every task of the cluster's chief and worker jobs, the client first."""
  return [f"{job}:{i}" for job in JOBS for i in range(len(cluster.get(job, ())))]


def _job_and_index(task: str) -> tuple[str, int]:
  """`("worker", 1)` for `"worker:1"`."""
  job, _, index = task.partition(":")
  return job, int(index)


def _address(cluster: dict[str, list[str]], task: str) -> str:
  job, index = _job_and_index(task)
  return cluster[job][index]


def _device(task: str, kind: str = "CPU", index: int | str = 0) -> str:
  """`task`'s device, e.g. `/job:worker/replica:0/task:1/device:CPU:0`
  (`index=""`: the prefix of all its devices of `kind`)."""
  job, task_index = _job_and_index(task)
  return f"/job:{job}/replica:0/task:{task_index}/device:{kind}:{index}"


# ---------------------------------------------------------- serving tasks

def serve(cluster: dict[str, list[str]], task: str, *,
          timeout_s: float = 300.0) -> int:
  """Serves the chief's in-graph run until it ends; the exit code.

  Args:
    cluster: the cluster spec (`{"worker": [...], ...}`).
    task: this task, e.g. `"worker:1"`.
    timeout_s: how long to wait for the chief to listen at all.

  Returns:
    The chief's exit code (42 after a preemption save), or 1 when the
    chief stopped without saying (or never came up).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  home = tempfile.mkdtemp(prefix="tfmgpu-task-")
  sigterm = threading.Event()
  chief = client_task(cluster)

  def on_sigterm(signum, frame) -> None:
    del signum, frame
    if not sigterm.is_set():
      logging.warning("SIGTERM received: the chief (%s) saves a checkpoint "
                      "at its next step boundary; this task serves it until "
                      "then.", chief)
      with open(os.path.join(home, SIGTERM_FILE), "w", encoding="utf-8"):
        pass
    sigterm.set()

  previous_dir = os.getcwd()
  previous = signal.signal(signal.SIGTERM, on_sigterm)
  os.chdir(home)  # The chief's relative paths resolve here.
  job, index = _job_and_index(task)
  try:
    tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                         task_index=index, protocol="grpc", start=True)
    logging.info("Task %s serves the chief's in-graph run (%s drives its "
                 "devices; its weights and slots live here).", task, chief)
    code, message = _wait_for_chief(home, _address(cluster, chief), chief,
                                    timeout_s, sigterm)
  finally:
    os.chdir(previous_dir)
    signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(home, ignore_errors=True)
  print(message, file=sys.stderr if code else sys.stdout, flush=True)
  return code


def _wait_for_chief(home: str, address: str, chief: str, timeout_s: float,
                    sigterm: threading.Event) -> tuple[int, str]:
  """The chief's exit file, or (1, why) once its port stops listening (or
  never listened within `timeout_s`); after SIGTERM, looked for at every
  poll (the chief may be stopping too)."""
  seen = False
  deadline = time.monotonic() + timeout_s
  next_look = 0.0
  path = os.path.join(home, EXIT_FILE)
  while True:
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        text = f.read()
      if text.endswith(_END):  # The chief's words: "this process" is it.
        code, _, message = text[:-len(_END)].partition("\n")
        return int(code), f"from the chief ({chief}): {message}"
    now = time.monotonic()
    if now >= next_look or sigterm.is_set():
      next_look = now + _CHIEF_POLL_S
      listening = not ports.wait_until_listening({chief: address}, 0)
      if seen and not listening:
        return 1, (f"error: the chief ({chief} at {address}) stopped without "
                   "saying how its run ended; see its log.")
      seen = seen or listening
      if not seen and now > deadline:
        return 1, (f"error: the chief ({chief} at {address}) did not come up "
                   f"within connect_timeout_s={timeout_s:g} s; see its log.")
    time.sleep(_POLL_S)


# ---------------------------------------------------------------- the chief

@dataclasses.dataclass
class _Driven:
  """This task, the serving tasks it drives, and when it last looked."""
  client: str
  tasks: list[str]
  checked_at: float = 0.0


_DRIVEN: _Driven | None = None


def connect(cluster: dict[str, list[str]], task: str, *,
            timeout_s: float) -> None:
  """Connects this process (the client, `client_task(cluster)`) to every
  task of the cluster, once each listens (within `timeout_s`).

  Raises:
    ValueError: `task` is not the client.
    RuntimeError: a task did not listen in time.
  """
  global _DRIVEN
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if task != client_task(cluster):
    raise ValueError(
        f"task {task} is not the client of the in-graph run "
        f"({client_task(cluster)} drives every task's devices): run it "
        "with python -m tfmgpu.train, whose other tasks only serve.")
  others = [t for t in tasks_of(cluster) if t != task]
  ports.require_listening(
      {t: _address(cluster, t) for t in others}, timeout_s,
      who="multi_worker_mirrored with zero_stage",
      waiter="the chief", log=logging.info)
  job, index = _job_and_index(task)
  tf.config.experimental_connect_to_cluster(
      tf.train.ClusterSpec(cluster), job_name=job, task_index=index)
  _DRIVEN = _Driven(task, others)
  logging.info("In-graph: this task (%s) drives the devices of %s.", task,
               ", ".join(others) or "no other task")


def driving() -> bool:
  """Whether this process drives other tasks' devices (`connect`)."""
  return bool(_DRIVEN and _DRIVEN.tasks)


def replica_devices() -> list[str]:
  """One replica per GPU of every task, else each task's CPU:0, the client
  first (as `MultiWorkerMirroredStrategy` replicates); without `connect`,
  this process's."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  names = [d.name for d in tf.config.list_logical_devices()]
  if _DRIVEN is None:  # One task alone.
    gpus = [n for n in names if "/device:GPU:" in n]
    return gpus or [n for n in names if "/device:CPU:" in n][:1]
  kind = "GPU" if any("/device:GPU:" in n for n in names) else "CPU"
  out = []
  for task in [_DRIVEN.client] + _DRIVEN.tasks:
    mine = [n for n in names if n.startswith(_device(task, kind, ""))]
    out.extend(mine if kind == "GPU" else mine[:1])
  return out


def planned_devices() -> list[str]:
  """The replica devices a run would use, before it connects (`--plan_only`):
  this host's GPU count (else one CPU) in every task of TF_CONFIG's cluster."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
  gpus = len(tf.config.list_logical_devices("GPU"))
  kind, count = ("GPU", gpus) if gpus else ("CPU", 1)
  return [_device(task, kind, i)
          for task in tasks_of(cluster) or ["worker:0"] for i in range(count)]


def preempted_task(*, now: float | None = None) -> str | None:
  """A serving task that received SIGTERM (checked at most every
  `CHECK_EVERY_S`; one small op on each task), else `None`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not driving():
    return None
  now = time.monotonic() if now is None else now
  if now - _DRIVEN.checked_at < CHECK_EVERY_S:
    return None
  _DRIVEN.checked_at = now
  for task in _DRIVEN.tasks:
    with tf.device(_device(task)):  # Eager: a traced constant would fold.
      if int(tf.size(tf.io.matching_files(SIGTERM_FILE))):
        return task
  return None


def release(code: int, message: str = "") -> None:
  """Tells every serving task that the run ended: its exit code and the
  message it prints. A task that is gone is logged and skipped."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not driving():
    return
  for task in _DRIVEN.tasks:
    try:
      with tf.device(_device(task)):
        tf.io.write_file(EXIT_FILE, f"{int(code)}\n{message}{_END}")
    except (tf.errors.OpError, RuntimeError) as e:
      logging.warning("Could not tell task %s that the run ended (%s).",
                      task, str(e).splitlines()[0] if str(e) else e)

