r"""Train a model on many devices: `python -m tfmgpu.train --strategy=mirrored`.

Flags become one `TrainConfig`; `tfmgpu.runs.run_training` does the work
(call it from a notebook with the same keyword arguments). `--help` and flag
errors answer before TensorFlow loads.

Examples:
  python -m tfmgpu.train --strategy=mirrored --virtual_devices=2 --epochs=5
  python -m tfmgpu.train --strategy=mirrored --num_gpus=4 \
      --global_batch_size=256 --mixed_precision=mixed_bfloat16
  python -m tfmgpu.train --flagfile=run.flags
  python -m tfmgpu.train --model=scripts/examples/two_input.py:build \
      --dataset=scripts/examples/two_input.py:load --virtual_devices=2
  python -m tfmgpu.launch --num_workers=2 -- \
      python -m tfmgpu.train --strategy=multi_worker_mirrored --model_dir=run

In a cluster (TF_CONFIG), every task runs the same command; the "ps" and
"worker" tasks of a parameter-server cluster only serve (tfmgpu/cluster.py).

Exit codes: 0 done; 1 bad input or a training error (the message says which);
42 (`checkpoints.EXIT_PREEMPTED`) stopped by SIGTERM or Ctrl-C after
saving a checkpoint (or by SIGTERM outside the training steps, e.g. in the
final evaluation, keeping the checkpoints): run the same command again to
resume; 130 a second
Ctrl-C (stopped at once; the checkpoints saved before are kept).
"""

from __future__ import annotations

import sys
import types

from absl import app
from absl import flags

from tfmgpu import cluster
from tfmgpu import config as config_lib
from tfmgpu import files
from tfmgpu import in_graph
from tfmgpu import flags as flags_lib
from tfmgpu import models as models_lib
from tfmgpu import rundir
from tfmgpu import strategies as strategies_lib
from tfmgpu import user_code
from tfmgpu.flags import autotune
from tfmgpu.flags import batch
from tfmgpu.flags import data
from tfmgpu.flags import devices
from tfmgpu.flags import execution
from tfmgpu.flags import planner
from tfmgpu.flags import stages
from tfmgpu.flags import strategy
from tfmgpu.flags import cli

for _group in (strategy, devices, data, batch, execution, stages, planner,
               autotune):
  flags.adopt_module_key_flags(_group)  # `--help` lists them too.

# Every other `TrainConfig` setting, made from its declaration.
_FLAGS = flags_lib.define_settings(config_lib.TrainConfig,
                                   module_name=__name__)
_VERBOSE = _FLAGS["verbose"]
_PLAN_ONLY = flags.DEFINE_bool(
    "plan_only", False, "Print the stage plan and memory estimate; no training.")
# The distribution `--strategy` names, as the flag check resolved it at
# parsing: `config_from_flags` hands it to the config (one lookup a run).
_RESOLVED: dict[str, strategies_lib.Distribution] = {}


@flags.multi_flags_validator(
    ["global_batch_size", "virtual_devices", "strategy", "num_replicas",
     "devices", "num_gpus"],
    message="--global_batch_size must divide by the replica count.")
def _batch_divides(values) -> bool:
  """A data-parallel strategy's replica rule, as an early flag error (the
  other rules are the config's, checked in `main`)."""
  distribution = strategies_lib.lookup(values["strategy"])
  _RESOLVED.clear()
  _RESOLVED[values["strategy"]] = distribution
  if distribution.kind is not strategies_lib.Kind.DATA_PARALLEL:
    return True
  try:  # Options it rejects are the config's to explain, in `main`.
    options = distribution.options_from(types.SimpleNamespace(**values))
  except ValueError:
    return True
  try:
    distribution.check_config(options, strategies_lib.RunFacts(
        values["global_batch_size"], values["virtual_devices"]))
  except ValueError as e:
    raise flags.ValidationError(f"--{e}") from None
  return True


@flags.validator("model")
def _known_model(value: str) -> bool:
  """A registered name, or a reference whose module defines the builder
  (read, not imported: before TensorFlow loads)."""
  try:
    models_lib.check_model(value)
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  return True


@flags.multi_flags_validator(["model", "model_size"])
def _known_model_size(values) -> bool:
  """A size the model has (checked before TensorFlow loads)."""
  try:
    models_lib.check_model_size(values["model"], values["model_size"])
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  return True


def config_from_flags() -> config_lib.TrainConfig:
  """Turns the parsed flags into one validated `TrainConfig` (with the
  distribution the flag check looked up)."""
  values = flags_lib.config_values(config_lib.TrainConfig)
  return config_lib.TrainConfig(
      **values, _distribution=_RESOLVED.get(values.get("strategy")))


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = config_from_flags()
  except config_lib.ConfigRuleError as e:  # Settings that clash: say which.
    print(f"error: {e}", file=sys.stderr)
    return 1
  except ValueError as e:  # One bad setting: absl adds the usage line.
    raise app.UsageError(str(e)) from None
  try:
    # TF_CONFIG and ports, before TF loads.
    role = cluster.preflight(config.cluster_target)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  # TF loads only when a step needs it, so that the checks that need none
  # (the run directory, its lock, the stage count) answer in a blink.
  flags_lib.prepare_quiet_tensorflow(tensorflow_logs=_VERBOSE.value >= 2)
  if role.runs_server:
    flags_lib.load_tensorflow()
  cluster.run_server_if_needed(role)  # Parameter-server ps/worker: serves.
  if cluster.serves_in_graph(role, config.cluster_target):
    return _serve_in_graph(config, role)  # The chief drives this task.
  if names_user_code(config):  # The user's module may import TF: quietly.
    flags_lib.load_tensorflow()
  try:  # The user's `module:function` code, imported before any run dir.
    config.check_user_code()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if _PLAN_ONLY.value:
    flags_lib.load_tensorflow()
    from tfmgpu import runs  # pylint: disable=g-import-not-at-top  (loads TF)
    try:
      print(runs.describe_plan(config))
    except ValueError as e:  # A model that cannot be split so, ...: say why.
      print(f"error: {e}", file=sys.stderr)
      return 1
    return 0
  return _train_in_run_dir(config, role)


def _serve_in_graph(config: config_lib.TrainConfig,
                    role: cluster.TaskRole) -> int:
  """Serves the chief's in-graph run (multi-worker ZeRO): this task's
  devices configured as the run says, then TF's server until the chief
  ends; the chief's exit code."""
  flags_lib.load_tensorflow()
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  devices_lib.configure_virtual_devices(config.virtual_devices)
  return in_graph.serve(role.cluster, role.name,
                        timeout_s=config.options.connect_timeout_s)


def _train_in_run_dir(config: config_lib.TrainConfig,
                      role: cluster.TaskRole) -> int:
  """Opens the run directory, trains; the exit code. A run that fails
  before writing anything removes the directories it created."""
  config = config.replace(
      model_dir=config.model_dir or rundir.default_model_dir(config.strategy))
  created = (rundir.missing_directories(config.model_dir)
             if cluster.writes_outputs(role, config.cluster_target) else [])
  code = 1
  try:
    try:  # The run directory, before TF loads: usable, unlocked, same run.
      config, lock = open_run_dir(config, role)
    except rundir.RunDirError as e:
      print(f"error: {e}", file=sys.stderr)
      return code
    except OSError as e:  # Writing run.json on a full disk, ...
      print(f"error: {files.describe_os_error(e)}", file=sys.stderr)
      return code
    try:
      flags_lib.load_tensorflow()
      code = _train(config)
      return code
    finally:
      lock.release()
  finally:
    if code:
      rundir.remove_unused(created)


def names_user_code(config: config_lib.TrainConfig) -> bool:
  """Whether `config` names the user's `module:function` code (whose
  import may import TensorFlow)."""
  return any(user_code.is_reference(v) for v in (
      config.model, config.dataset, config.loss, *(config.metrics or ())))


def open_run_dir(config: config_lib.TrainConfig, role: cluster.TaskRole
                 ) -> tuple[config_lib.TrainConfig, rundir.RunLock]:
  """Creates, locks (the chief) and checks the run directory against its
  record (`tfmgpu.rundir`); returns the config naming it and the lock."""
  model_dir = config.model_dir or rundir.default_model_dir(config.strategy)
  config = config.replace(model_dir=model_dir)
  lock = rundir.open_run(model_dir, rundir.record_of(config.recorded_run),
                         chief=cluster.writes_outputs(role,
                                                      config.cluster_target))
  return config, lock


def _train(config: config_lib.TrainConfig) -> int:
  """Runs the training; the exit code (42 after a preemption save). Tasks
  that serve this one in-graph learn the code and the last line."""
  code, line = 1, ("error: the chief stopped on an unexpected error; see "
                   "its log.")
  try:
    code, line = _train_once(config)
  finally:
    in_graph.release(code, line)
  return code


def _train_once(config: config_lib.TrainConfig) -> tuple[int, str]:
  """`_train`'s run: the exit code and the line printed last."""
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top  (loads TF)
  from tfmgpu.training import checkpoints  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import preemption  # pylint: disable=g-import-not-at-top
  # A SIGTERM resent after the preemption save keeps exit 42: the watcher
  # leaves SIGTERM ignored until this process exits (only for this call).
  preemption.hold_sigterm_after_preemption()
  preemption.interrupt_saves()  # Ctrl-C saves as SIGTERM does.
  preemption.sigterm_stops_at_once(  # Outside the steps: 42, not 143.
      said=f"error: {_stopped_outside_steps(config.model_dir)}")
  try:
    summary = runs.run_training(config)
  except checkpoints.PreemptedError as e:
    return _failed(checkpoints.EXIT_PREEMPTED, str(e))
  except preemption.SigtermOutsideSteps:
    return _failed(checkpoints.EXIT_PREEMPTED, _stopped_outside_steps(
        config.model_dir))
  except KeyboardInterrupt:
    return _failed(cli.INTERRUPTED_EXIT_CODE,
                   "interrupted (Ctrl-C) at once: the checkpoints already in "
                   f"{config.model_dir or 'the run directory'} are kept; the "
                   "same command resumes from the latest.")
  except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError) as e:
    return _failed(1, user_code.describe_error(e))
  except OSError as e:  # A full disk while saving, ...: say so, name it.
    return _failed(1, files.describe_os_error(e))
  finally:
    preemption.hold_sigterm_after_preemption(False)
    preemption.interrupt_saves(False)
    preemption.sigterm_stops_at_once(False)
  print("\n" + str(summary), flush=True)
  return 0, "The chief's run finished (its summary is in the chief's log)."


def _stopped_outside_steps(model_dir: str) -> str:
  return ("Preempted: SIGTERM reached this process outside the training "
          "steps (before them, in the final evaluation or while model.keras "
          f"was saved) and stopped it at once. The checkpoints in {model_dir} "
          "are kept, the latest with the weights trained so far (model.keras "
          "is written whole or not at all). Run the same command again to "
          "resume; once training is done it evaluates and saves the model "
          "(python -m tfmgpu.train exits with code 42).")


def _failed(code: int, message: str) -> tuple[int, str]:
  print(f"error: {message}", file=sys.stderr)
  return code, f"error: {message}"


def run() -> None:
  """Console-script entry point (`tfmgpu-train`)."""
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
