r"""Train a model on many devices: `python -m tfmgpu.train --strategy=mirrored`.

Flags become one `TrainConfig`; `tfmgpu.experiment.run_training` does the
work (call it from a notebook with the same keyword arguments). `--help`
and flag errors answer before TensorFlow loads.

Examples:
  python -m tfmgpu.train --strategy=mirrored --virtual_devices=2 --epochs=5
  python -m tfmgpu.train --strategy=mirrored --num_gpus=4 \
      --global_batch_size=256 --mixed_precision=mixed_bfloat16
  python -m tfmgpu.train --flagfile=run.flags
  python scripts/launch_local_cluster.py --num_workers=2 -- \
      python -m tfmgpu.train --strategy=multi_worker_mirrored --model_dir=run

In a cluster (TF_CONFIG), every task runs the same command; the "ps" and
"worker" tasks of a parameter-server cluster only serve (tfmgpu/cluster.py).

Exit codes: 0 done; 1 bad input or a training error (the message says which);
42 (`checkpoints.EXIT_PREEMPTED`) stopped by SIGTERM after saving a
checkpoint: run the same command again to resume.
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

from tfmgpu import cli_flags as cf
from tfmgpu import cluster
from tfmgpu import config as config_lib

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

_GRADIENT_COMPRESSION = flags.DEFINE_enum(
    "gradient_compression", "none", list(config_lib.COMPRESSION_CHOICES),
    "All-reduce gradients in 16 bits (half the bytes on the wire).")

_BYTES_PER_PACK = flags.DEFINE_integer(
    "bytes_per_pack", 0, "All-reduce pack size in bytes (0: TF's default).",
    lower_bound=0)

_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Checkpoints, summaries and model.keras go here; an "
    "existing directory is resumed. Default: a new runs/<time>-<strategy>.")

_PLAN_ONLY = flags.DEFINE_bool(
    "plan_only", False, "Print the stage plan and memory estimate; no training.")


def config_from_flags() -> config_lib.TrainConfig:
  """Turns the parsed flags into one validated `TrainConfig`."""
  return config_lib.TrainConfig(
      strategy=cf.STRATEGY.value, virtual_devices=cf.VIRTUAL_DEVICES.value,
      devices=tuple(cf.DEVICES.value) if cf.DEVICES.value else None,
      num_gpus=cf.NUM_GPUS.value, num_replicas=cf.NUM_REPLICAS.value,
      cross_device_ops=cf.CROSS_DEVICE_OPS.value, num_packs=cf.NUM_PACKS.value,
      single_replica=cf.SINGLE_REPLICA.value,
      communication=cf.COMMUNICATION.value,
      cluster_resolver=cf.CLUSTER_RESOLVER.value, model=cf.MODEL.value,
      dataset=cf.DATASET.value, data_path=cf.DATA_PATH.value,
      global_batch_size=cf.GLOBAL_BATCH_SIZE.value, epochs=_EPOCHS.value,
      steps_per_epoch=_STEPS_PER_EPOCH.value, optimizer=_OPTIMIZER.value,
      learning_rate=_LEARNING_RATE.value, clip_norm=_CLIP_NORM.value,
      gradient_compression=_GRADIENT_COMPRESSION.value,
      bytes_per_pack=_BYTES_PER_PACK.value,
      mixed_precision=cf.MIXED_PRECISION.value,
      steps_per_execution=cf.STEPS_PER_EXECUTION.value,
      jit_compile=cf.JIT_COMPILE.value,
      fused_optimizer=cf.FUSED_OPTIMIZER.value,
      input_mode=cf.INPUT_MODE.value, model_dir=_MODEL_DIR.value,
      seed=cf.SEED.value, num_stages=cf.NUM_STAGES.value,
      partition=cf.PARTITION.value,
      split_points=tuple(cf.SPLIT_POINTS.value) if cf.SPLIT_POINTS.value else None,
      micro_batches=cf.MICRO_BATCHES.value, schedule=cf.SCHEDULE.value,
      recompute=cf.RECOMPUTE.value, verbose=cf.VERBOSE.value)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = config_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  try:
    role = cluster.preflight(config)  # TF_CONFIG and ports, before TF loads.
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  cf.quiet_tensorflow()
  cluster.run_server_if_needed(role)  # Parameter-server ps/worker: serves.
  from tfmgpu import experiment  # pylint: disable=g-import-not-at-top  (loads TF)
  from tfmgpu.training import checkpoints  # pylint: disable=g-import-not-at-top
  if _PLAN_ONLY.value:
    print(experiment.describe_plan(config))
    return 0
  try:
    summary = experiment.run_training(config)
  except checkpoints.PreemptedError as e:
    print(f"error: {e}", file=sys.stderr)
    return checkpoints.EXIT_PREEMPTED
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
