r"""Run a command once per task of a local TensorFlow cluster.

A thin command line over `tfmgpu.launcher.launch`: every task gets its own
TF_CONFIG (and TFMGPU_TASK="worker:0"), its output is printed with a
"[worker:0] " prefix, and the exit code is 0 only if the run succeeded:
124 on --timeout_s; on Ctrl-C (or SIGTERM) the tasks are stopped with
SIGTERM, and the code is 42 when every task that trains saved a checkpoint
and exited 42 (python -m tfmgpu.train does: rerun to resume), else 130
(143); 42 also when the signal went to one task and every task that
trains saved and exited 42; otherwise the first failed task's code. See `tfmgpu.launcher` for
the full contract. `scripts/launch_local_cluster.py` runs the same command
line from a checkout.

Everything after `--` is the command:

  python -m tfmgpu.launch --num_workers=2 -- \
      python -m tfmgpu.train --strategy=multi_worker_mirrored ...

  python -m tfmgpu.launch --num_workers=2 --num_ps=1 \
      --coordinator -- python -m tfmgpu.train --strategy=parameter_server ...
"""

from collections.abc import Sequence

from absl import app
from absl import flags

from tfmgpu import launcher
from tfmgpu.flags import cli

_NUM_WORKERS = flags.DEFINE_integer(
    "num_workers", 2, "Number of 'worker' tasks.", lower_bound=1)
_NUM_PS = flags.DEFINE_integer(
    "num_ps", 0, "Number of 'ps' (parameter server) tasks; 0 for "
    "multi-worker mirrored.", lower_bound=0)
_COORDINATOR = flags.DEFINE_bool(
    "coordinator", False, "Also run a 'chief' task: the coordinator of "
    "parameter-server training (with --num_ps=0: a multi-worker chief).")
_HOST = flags.DEFINE_string(
    "host", "127.0.0.1", "Address the tasks use to reach each other.")
_BASE_PORT = flags.DEFINE_integer(
    "base_port", None, "First of consecutive ports for the tasks (chief, "
    "workers, then ps). Default: pick free ports.", lower_bound=1,
    upper_bound=65535)
_TIMEOUT_S = flags.DEFINE_float(
    "timeout_s", None, "Stop all tasks after this many seconds (exit code "
    "124). Default: no limit.")
_GRACE_S = flags.DEFINE_float(
    "grace_s", 10.0, "Seconds between SIGTERM and SIGKILL when stopping "
    "tasks.", lower_bound=0.0)

flags.register_validator(
    "timeout_s", lambda value: value is None or value > 0,
    message="--timeout_s must be a number of seconds > 0; leave it unset "
    "for no limit.")


def main(argv: Sequence[str]) -> int:
  command = list(argv[1:])
  if not command:
    raise app.UsageError(
        "No command given. Put the command every task runs after '--', e.g. "
        "--num_workers=2 -- python -m tfmgpu.train "
        "--strategy=multi_worker_mirrored")
  try:
    result = launcher.launch(
        command, num_workers=_NUM_WORKERS.value, num_ps=_NUM_PS.value,
        chief=_COORDINATOR.value, host=_HOST.value,
        base_port=_BASE_PORT.value, timeout_s=_TIMEOUT_S.value,
        grace_s=_GRACE_S.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  return result.exit_code


def run() -> None:
  """Entry point of `python -m tfmgpu.launch` and its script wrapper."""
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
