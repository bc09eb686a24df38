"""Run a local TensorFlow cluster: a process per task, each with its TF_CONFIG.

`launch` starts one command once per task of a local cluster and supervises
the processes; `python -m tfmgpu.launch` is its command line:

    python -m tfmgpu.launch --num_workers=2 -- \\
        python -m tfmgpu.train --strategy=multi_worker_mirrored ...

This package only starts processes: it never imports TensorFlow. Its modules:
`cluster_spec` (tasks, ports, TF_CONFIG), `processes` (one task's process
group) and `supervisor` (`launch`: start, wait, stop).

Contract with the command:

* Every task runs the same command with the launcher's environment plus
  `TF_CONFIG`, the JSON TensorFlow's `TFConfigClusterResolver` reads
  (`{"cluster": {"chief": [...], "worker": [...], "ps": [...]},
  "task": {"type": "worker", "index": 0}}`), `TFMGPU_TASK` (the same task as
  `"worker:0"`, for logs), `TFMGPU_STOP_NOTE` (the file where the launcher
  says why it stops the tasks, before it does: `tfmgpu.stop_notes`) and
  `PYTHONUNBUFFERED=1` (unless already set) so that Python output streams
  live.
* Multi-worker mirrored (`num_ps=0`): every task trains and must exit 0.
  `chief=True` adds a "chief" task, which TF treats as worker 0.
* Parameter server (`num_ps>0`): the command reads its task type from
  TF_CONFIG. "ps" and "worker" tasks start a `tf.distribute.Server` and join
  it, which never returns; the "chief" task (`chief=True`) is the coordinator
  that runs the training. Servers never exit on their own, so the launcher
  waits only for the tasks that do the work -- the chief if there is one,
  else the workers -- and once all of those have exited 0 it stops the
  remaining (server) tasks with SIGTERM and still reports success. With a
  coordinator, a lost worker is logged and tolerated (the coordinator
  reschedules its steps), and stopping goes coordinator first (time to
  save), then workers, then parameter servers.

Lifecycle (see `supervisor`): each task leads its own process group, its
output is printed line by line as `[worker:0] ...`; the first failure, the
timeout or a signal to the launcher stops every task (SIGTERM, then SIGKILL
after `grace_s`), and no process group outlives the launcher. POSIX only.
"""

from tfmgpu.launcher.cluster_spec import TASK_TYPES
from tfmgpu.launcher.cluster_spec import ClusterConfig
from tfmgpu.launcher.cluster_spec import make_cluster
from tfmgpu.launcher.cluster_spec import tf_config_for
from tfmgpu.launcher.supervisor import EXIT_TIMEOUT
from tfmgpu.launcher.supervisor import LaunchResult
from tfmgpu.launcher.supervisor import Outcome
from tfmgpu.launcher.supervisor import launch
from tfmgpu.ports import PortInUseError

__all__ = [
    "EXIT_TIMEOUT",
    "TASK_TYPES",
    "ClusterConfig",
    "LaunchResult",
    "Outcome",
    "PortInUseError",
    "launch",
    "make_cluster",
    "tf_config_for",
]
