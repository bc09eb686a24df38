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
42 (`checkpoints.EXIT_PREEMPTED`) stopped by SIGTERM after saving a
checkpoint: run the same command again to resume.
"""

from __future__ import annotations

import sys
import types

from absl import app
from absl import flags

from tfmgpu import cluster
from tfmgpu import config as config_lib
from tfmgpu import files
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
from tfmgpu.placements import pipeline
from tfmgpu.training.choices import COMPRESSION_CHOICES
from tfmgpu.training.choices import DEVICE_DATA_MAX_MIB
from tfmgpu.training.choices import INPUT_MODE_CHOICES
from tfmgpu.training.optimizers import OPTIMIZER_CHOICES

for _group in (strategy, devices, data, batch, execution, stages, planner,
               autotune):
  flags.adopt_module_key_flags(_group)  # `--help` lists them too.

_MODEL = flags.DEFINE_string(
    "model", "convnet",
    f"<{' | '.join(models_lib.available_models())}>, or your own builder as "
    f"{user_code.FORMS}, called as build(input_shape, num_classes) -> "
    "keras.Model (input_shape nested like the data's x for several inputs).")
_MODEL_SIZE = flags.DEFINE_string(
    "model_size", None, "A named size of --model, for models that have them: "
    + "; ".join(f"{name}: <{' | '.join(sizes)}>"
                for name, sizes in models_lib.model_sizes().items())
    + ". Default: the model's own (gpt: tiny).")
_MODEL_PRESET = flags.DEFINE_string(
    "model_preset", None, "A local keras_hub preset directory (config.json "
    "and weights; nothing is downloaded) that a keras_hub --model (gpt2, "
    "llama, gemma, qwen) loads instead of building --model_size.")
_LOSS = flags.DEFINE_string(
    "loss", None, "A Keras loss name (e.g. mse, binary_crossentropy) or your "
    f"fn(y_true, y_pred) as {user_code.FORMS}. Default: sparse categorical "
    "cross-entropy from logits, which the built-in models output (by name, "
    "sparse_categorical_crossentropy expects probabilities).")
_METRICS = flags.DEFINE_list(
    "metrics", None, "Keras metric names (e.g. accuracy,mae) or your "
    "fn(y_true, y_pred) as references, comma-separated; reported per epoch "
    "and in the summary; language models also take bits_per_byte and "
    "perplexity (from logits). Default: the dataset's (accuracy; "
    "stdlib_text: bits_per_byte,perplexity,accuracy) with the default loss, "
    "none with --loss.")
_EPOCHS = flags.DEFINE_integer("epochs", 5, "Epochs to train.", lower_bound=1)
_STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch", None, "Steps per epoch (default: one pass).",
    lower_bound=1)
_OPTIMIZER = flags_lib.define_choice(
    "optimizer", "adam", list(OPTIMIZER_CHOICES), "Optimizer.",
    module_name=__name__)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 2e-3, "Learning rate.", lower_bound=0.0)
_CLIP_NORM = flags.DEFINE_float(
    "clip_norm", None, "Clip gradients to this global norm.")
_GRADIENT_COMPRESSION = flags_lib.define_choice(
    "gradient_compression", "none", list(COMPRESSION_CHOICES),
    "All-reduce gradients in 16 bits (half the bytes on the wire).",
    module_name=__name__)
_BYTES_PER_PACK = flags.DEFINE_integer(
    "bytes_per_pack", 0, "All-reduce pack size in bytes (0: TF's default).",
    lower_bound=0)
_MIXED_PRECISION = flags_lib.define_choice(
    "mixed_precision", "float32", list(models_lib.MIXED_PRECISION_POLICIES),
    "Keras dtype policy; mixed_float16 adds loss scaling.",
    module_name=__name__)
_JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False, "XLA-compile each replica's forward/backward.")
_FUSED_OPTIMIZER = flags.DEFINE_bool(
    "fused_optimizer", True, "Update each variable with one fused kernel "
    "(adam, adamw, sgd, momentum); false: Keras's per-op update.")
_INPUT_MODE = flags_lib.define_choice(
    "input_mode", "auto", list(INPUT_MODE_CHOICES),
    "device: hold the training arrays on each replica's device and gather "
    "batches there; tf_data: a tf.data pipeline; auto: device on one host "
    f"when all replicas' copies take <= {DEVICE_DATA_MAX_MIB} MiB. A "
    "tf.data.Dataset on CPU replicas is read once on the host and split in "
    "the step, unless tf_data (TF's distributed iterator).",
    module_name=__name__)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and data order.")
_SKIP_DAMAGED_SHARDS = flags.DEFINE_bool(
    "skip_damaged_shards", False, "--dataset=tfrecord: read every shard "
    "through first and train without the damaged ones (logged); off, a "
    "damaged shard stops the run, naming it.")
_SCHEDULE = flags_lib.define_choice(
    "schedule", "gpipe", list(pipeline.SCHEDULE_CHOICES), "Pipeline schedule.",
    module_name=__name__)
_RECOMPUTE = flags.DEFINE_bool(
    "recompute", False, "Pipeline: recompute activations in the backward.")
_COMMUNICATION = flags_lib.define_choice(
    "communication", "auto", list(strategies_lib.COMMUNICATION_CHOICES),
    "Collective implementation for 'multi_worker_mirrored'.",
    module_name=__name__)
_CLUSTER_RESOLVER = flags_lib.define_choice(
    "cluster_resolver", "tf_config", list(strategies_lib.CLUSTER_RESOLVERS),
    "Where the cluster comes from for multi-worker strategies.",
    module_name=__name__)
_VARIABLE_SHARDS = flags.DEFINE_integer(
    "variable_shards", None, "'parameter_server': split each variable over "
    "this many parameter servers.", lower_bound=1)
_CONNECT_TIMEOUT_S = flags.DEFINE_float(
    "connect_timeout_s", None, "'parameter_server': seconds the coordinator "
    "waits for every ps and worker task to listen before it stops with an "
    "error naming the missing ones (default 300).", lower_bound=0.001)
_PARAMETER_DEVICE = flags.DEFINE_string(
    "parameter_device", None, "'central_storage': where the variables live "
    "(default /cpu:0).")
_TPU = flags.DEFINE_string(
    "tpu", "", "'tpu': the TPU's name or address (empty: this TPU VM's).")
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Checkpoints, TensorBoard summaries (the run's "
    "summary prints the tensorboard --logdir command) and model.keras go "
    "here; an existing directory is resumed. Default: a new "
    "runs/<time>-<strategy>.")
_CHECKPOINT_EVERY_STEPS = flags.DEFINE_integer(
    "checkpoint_every_steps", None, "Also save a checkpoint every N global "
    "steps, not only per epoch (a kill then loses < N steps).", lower_bound=1)
_CHECKPOINT_EVERY_S = flags.DEFINE_float(
    "checkpoint_every_s", None, "Also save a checkpoint every N seconds of "
    "training, not only per epoch.", lower_bound=0.001)
_VERBOSE = flags.DEFINE_integer(
    "verbose", 1, "0: one log line per epoch; 1: a progress line (one plain "
    "line per epoch when stdout is not a terminal); 2: that and "
    "TensorFlow's own log messages (hidden otherwise, unless "
    "TF_CPP_MIN_LOG_LEVEL is set).", lower_bound=0, upper_bound=2)
_PLAN_ONLY = flags.DEFINE_bool(
    "plan_only", False, "Print the stage plan and memory estimate; no training.")


@flags.multi_flags_validator(
    ["global_batch_size", "virtual_devices", "strategy", "num_replicas",
     "devices", "num_gpus"],
    message="--global_batch_size must divide by the replica count.")
def _batch_divides(values) -> bool:
  """A data-parallel strategy's replica rule, as an early flag error (the
  other rules are the config's, checked in `main`)."""
  distribution = strategies_lib.lookup(values["strategy"])
  if distribution.kind is strategies_lib.Kind.DATA_PARALLEL:
    try:
      distribution.check_config(types.SimpleNamespace(**values))
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
  """Turns the parsed flags into one validated `TrainConfig`."""
  return config_lib.TrainConfig(
      **strategy.values(), **stages.values(), **planner.values(),
      virtual_devices=devices.VIRTUAL_DEVICES.value,
      communication=_COMMUNICATION.value,
      cluster_resolver=_CLUSTER_RESOLVER.value,
      variable_shards=_VARIABLE_SHARDS.value,
      connect_timeout_s=_CONNECT_TIMEOUT_S.value,
      parameter_device=_PARAMETER_DEVICE.value, tpu=_TPU.value,
      model=_MODEL.value, model_size=_MODEL_SIZE.value,
      model_preset=_MODEL_PRESET.value,
      dataset=data.DATASET.value,
      data_path=data.DATA_PATH.value, loss=_LOSS.value,
      metrics=_METRICS.value,
      global_batch_size=batch.GLOBAL_BATCH_SIZE.value, epochs=_EPOCHS.value,
      steps_per_epoch=_STEPS_PER_EPOCH.value, optimizer=_OPTIMIZER.value,
      learning_rate=_LEARNING_RATE.value, clip_norm=_CLIP_NORM.value,
      gradient_compression=_GRADIENT_COMPRESSION.value,
      bytes_per_pack=_BYTES_PER_PACK.value,
      mixed_precision=_MIXED_PRECISION.value,
      steps_per_execution=execution.STEPS_PER_EXECUTION.value,
      jit_compile=_JIT_COMPILE.value, fused_optimizer=_FUSED_OPTIMIZER.value,
      input_mode=_INPUT_MODE.value, autotune=autotune.enabled(False),
      model_dir=_MODEL_DIR.value,
      checkpoint_every_steps=_CHECKPOINT_EVERY_STEPS.value,
      checkpoint_every_s=_CHECKPOINT_EVERY_S.value,
      seed=_SEED.value, skip_damaged_shards=_SKIP_DAMAGED_SHARDS.value,
      schedule=_SCHEDULE.value, recompute=_RECOMPUTE.value,
      verbose=_VERBOSE.value)


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
    role = cluster.preflight(config)  # TF_CONFIG and ports, before TF loads.
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  # TF loads only when a step needs it, so that the checks that need none
  # (the run directory, its lock, the stage count) answer in a blink.
  flags_lib.prepare_quiet_tensorflow(tensorflow_logs=_VERBOSE.value >= 2)
  if role.runs_server:
    flags_lib.load_tensorflow()
  cluster.run_server_if_needed(role)  # Parameter-server ps/worker: serves.
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


def _train_in_run_dir(config: config_lib.TrainConfig,
                      role: cluster.TaskRole) -> int:
  """Opens the run directory, trains; the exit code. A run that fails
  before writing anything removes the directories it created."""
  config = config.replace(
      model_dir=config.model_dir or rundir.default_model_dir(config.strategy))
  created = (rundir.missing_directories(config.model_dir)
             if cluster.writes_outputs(role, config) else [])
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
  lock = rundir.open_run(model_dir, rundir.record_of(config),
                         chief=cluster.writes_outputs(role, config))
  return config, lock


def _train(config: config_lib.TrainConfig) -> int:
  """Runs the training; the exit code (42 after a preemption save)."""
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top  (loads TF)
  from tfmgpu.training import checkpoints  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import preemption  # pylint: disable=g-import-not-at-top
  # A SIGTERM resent after the preemption save keeps exit 42: the watcher
  # leaves SIGTERM ignored until this process exits (only for this call).
  preemption.hold_sigterm_after_preemption()
  try:
    summary = runs.run_training(config)
  except checkpoints.PreemptedError as e:
    print(f"error: {e}", file=sys.stderr)
    return checkpoints.EXIT_PREEMPTED
  except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except OSError as e:  # A full disk while saving, ...: say so, name it.
    print(f"error: {files.describe_os_error(e)}", file=sys.stderr)
    return 1
  finally:
    preemption.hold_sigterm_after_preemption(False)
  print("\n" + str(summary), flush=True)
  return 0


def run() -> None:
  """Console-script entry point (`tfmgpu-train`)."""
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
