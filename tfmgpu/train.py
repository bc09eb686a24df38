r"""Train a model on many devices: `python -m tfmgpu.train --strategy=mirrored`.

Flags become one `TrainConfig`; `tfmgpu.experiment.run_training` does the
work (call it from a notebook with the same keyword arguments). `--help`
and flag errors answer before TensorFlow loads.

Examples:
  python -m tfmgpu.train --strategy=mirrored --virtual_devices=2 --epochs=5
  python -m tfmgpu.train --strategy=mirrored --num_gpus=4 \
      --global_batch_size=256 --mixed_precision=mixed_bfloat16
  python -m tfmgpu.train --flagfile=run.flags
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

from tfmgpu import config as config_lib
from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib

_STRATEGY = flags.DEFINE_enum(
    "strategy", "mirrored", list(strategies_lib.available_strategies()),
    "How to spread work over devices; see tfmgpu.available_strategies().")
_VIRTUAL_DEVICES = flags.DEFINE_integer(
    "virtual_devices", None, "Split the GPU (else the CPU) into this many "
    "logical devices first: simulates a multi-device host.", lower_bound=1)
_DEVICES = flags.DEFINE_list(
    "devices", None, "Explicit replica devices, e.g. /gpu:0,/gpu:1.")
_NUM_GPUS = flags.DEFINE_integer(
    "num_gpus", None, "Use the first N GPUs.", lower_bound=0)
_NUM_REPLICAS = flags.DEFINE_integer(
    "num_replicas", None, "Use the first N accelerator devices (GPUs, else "
    "logical CPUs).", lower_bound=1)
_CROSS_DEVICE_OPS = flags.DEFINE_enum(
    "cross_device_ops", "auto", list(strategies_lib.CROSS_DEVICE_OPS_CHOICES),
    "All-reduce implementation for 'mirrored'; auto picks NCCL only when "
    "every replica is a GPU.")
_NUM_PACKS = flags.DEFINE_integer(
    "num_packs", 1, "Gradient packs for all-reduce.", lower_bound=1)
_COMMUNICATION = flags.DEFINE_enum(
    "communication", "auto", list(strategies_lib.COMMUNICATION_CHOICES),
    "Collective implementation for 'multi_worker_mirrored'.")
_CLUSTER_RESOLVER = flags.DEFINE_enum(
    "cluster_resolver", "tf_config", list(strategies_lib.CLUSTER_RESOLVERS),
    "Where the cluster comes from for multi-worker strategies.")
_MODEL = flags.DEFINE_enum(
    "model", "convnet", list(models_lib.available_models()), "Model to train.")
_DATASET = flags.DEFINE_enum(
    "dataset", "digits", list(data_lib.available_datasets()),
    "Dataset; 'digits' ships offline.")
_DATA_PATH = flags.DEFINE_string(
    "data_path", None, ".npz file (x_train, y_train, x_test, y_test) for "
    "--dataset=npz, or a local copy of a downloadable dataset.")
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 64, "Examples per step over all replicas.",
    lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 5, "Epochs to train.", lower_bound=1)
_STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch", None, "Steps per epoch (default: one pass).",
    lower_bound=1)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "adam", list(config_lib.OPTIMIZER_CHOICES), "Optimizer.")
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 2e-3, "Learning rate.", lower_bound=0.0)
_CLIP_NORM = flags.DEFINE_float(
    "clip_norm", None, "Clip gradients to this global norm.")
_MIXED_PRECISION = flags.DEFINE_enum(
    "mixed_precision", "float32", list(models_lib.MIXED_PRECISION_POLICIES),
    "Keras dtype policy; mixed_float16 adds loss scaling.")
_STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", 10, "Steps per tf.function call.", lower_bound=1)
_JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False, "XLA-compile each replica's forward/backward.")
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Checkpoints, summaries and model.keras go here; an "
    "existing directory is resumed. Default: a new runs/<time>-<strategy>.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and data order.")
_NUM_STAGES = flags.DEFINE_integer(
    "num_stages", 2, "Stages for model_parallel/pipeline.", lower_bound=1)
_PARTITION = flags.DEFINE_enum(
    "partition", "balanced", list(config_lib.PARTITION_CHOICES),
    "Cost that stages are balanced by.")
_SPLIT_POINTS = flags.DEFINE_list(
    "split_points", None, "Explicit stage boundaries (layer names).")
_MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", 4, "Micro-batches per step for 'pipeline'.", lower_bound=1)
_SCHEDULE = flags.DEFINE_enum(
    "schedule", "gpipe", list(config_lib.SCHEDULE_CHOICES),
    "Pipeline schedule.")
_RECOMPUTE = flags.DEFINE_bool(
    "recompute", False, "Pipeline: recompute activations in the backward.")
_PLAN_ONLY = flags.DEFINE_bool(
    "plan_only", False, "Print the stage plan and memory estimate; no training.")
_VERBOSE = flags.DEFINE_integer("verbose", 1, "1: progress bar; 0: log lines.")


@flags.multi_flags_validator(
    ["global_batch_size", "virtual_devices", "strategy", "num_replicas"],
    message="--global_batch_size must be divisible by the replica count.")
def _batch_divisible(values) -> bool:
  replicas = values["num_replicas"] or values["virtual_devices"]
  if values["strategy"] not in ("mirrored", "central_storage") or not replicas:
    return True
  if values["global_batch_size"] % replicas:
    raise flags.ValidationError(
        f"--global_batch_size={values['global_batch_size']} is not divisible "
        f"by the {replicas} replicas. Use a multiple of {replicas}.")
  return True


def quiet_tensorflow() -> None:
  """Keeps TF's INFO chatter and a known tf.data warning out of CLI output."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  py_logging.getLogger("tensorflow").setLevel(py_logging.WARNING)
  warnings.filterwarnings(
      "ignore", message="To make it possible to preserve tf.data options")


def config_from_flags() -> config_lib.TrainConfig:
  """Turns the parsed flags into one validated `TrainConfig`."""
  return config_lib.TrainConfig(
      strategy=_STRATEGY.value, virtual_devices=_VIRTUAL_DEVICES.value,
      devices=tuple(_DEVICES.value) if _DEVICES.value else None,
      num_gpus=_NUM_GPUS.value, num_replicas=_NUM_REPLICAS.value,
      cross_device_ops=_CROSS_DEVICE_OPS.value, num_packs=_NUM_PACKS.value,
      communication=_COMMUNICATION.value,
      cluster_resolver=_CLUSTER_RESOLVER.value, model=_MODEL.value,
      dataset=_DATASET.value, data_path=_DATA_PATH.value,
      global_batch_size=_GLOBAL_BATCH_SIZE.value, epochs=_EPOCHS.value,
      steps_per_epoch=_STEPS_PER_EPOCH.value, optimizer=_OPTIMIZER.value,
      learning_rate=_LEARNING_RATE.value, clip_norm=_CLIP_NORM.value,
      mixed_precision=_MIXED_PRECISION.value,
      steps_per_execution=_STEPS_PER_EXECUTION.value,
      jit_compile=_JIT_COMPILE.value, model_dir=_MODEL_DIR.value,
      seed=_SEED.value, num_stages=_NUM_STAGES.value,
      partition=_PARTITION.value,
      split_points=tuple(_SPLIT_POINTS.value) if _SPLIT_POINTS.value else None,
      micro_batches=_MICRO_BATCHES.value, schedule=_SCHEDULE.value,
      recompute=_RECOMPUTE.value, verbose=_VERBOSE.value)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = config_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  quiet_tensorflow()
  from tfmgpu import experiment  # pylint: disable=g-import-not-at-top  (loads TF)
  if _PLAN_ONLY.value:
    print(experiment.describe_plan(config))
    return 0
  try:
    summary = experiment.run_training(config)
  except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print("\n" + str(summary), flush=True)
  return 0


def run() -> None:
  """Console-script entry point (`tfmgpu-train`)."""
  app.run(main)


if __name__ == "__main__":
  run()
