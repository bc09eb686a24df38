"""Flags shared by the CLIs (train, predict, bench): defined once, here.

Each CLI imports this module, so the same flag has the same name, help and
choices everywhere (and two CLIs can be imported in one process). Choices
come from the registries. Library code never imports this module.
"""

from __future__ import annotations

from absl import flags

from tfmgpu import config as config_lib
from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib

STRATEGY = flags.DEFINE_enum(
    "strategy", "mirrored", list(strategies_lib.available_strategies()),
    "How to spread work over devices; see tfmgpu.available_strategies().")
VIRTUAL_DEVICES = flags.DEFINE_integer(
    "virtual_devices", None, "Split the GPU (else the CPU) into this many "
    "logical devices first: simulates a multi-device host.", lower_bound=1)
DEVICES = flags.DEFINE_list(
    "devices", None, "Explicit replica devices, e.g. /gpu:0,/gpu:1.")
NUM_GPUS = flags.DEFINE_integer(
    "num_gpus", None, "Use the first N GPUs.", lower_bound=0)
NUM_REPLICAS = flags.DEFINE_integer(
    "num_replicas", None, "Use the first N accelerator devices (GPUs, else "
    "logical CPUs).", lower_bound=1)
CROSS_DEVICE_OPS = flags.DEFINE_enum(
    "cross_device_ops", "auto", list(strategies_lib.CROSS_DEVICE_OPS_CHOICES),
    "All-reduce implementation for 'mirrored'; auto picks NCCL only when "
    "every replica is a GPU.")
NUM_PACKS = flags.DEFINE_integer(
    "num_packs", 1, "Gradient packs for all-reduce.", lower_bound=1)
SINGLE_REPLICA = flags.DEFINE_enum(
    "single_replica", "default", list(strategies_lib.SINGLE_REPLICA_CHOICES),
    "'mirrored' with one replica: 'default' skips MirroredStrategy's "
    "overhead; 'mirrored' keeps it.")
COMMUNICATION = flags.DEFINE_enum(
    "communication", "auto", list(strategies_lib.COMMUNICATION_CHOICES),
    "Collective implementation for 'multi_worker_mirrored'.")
CLUSTER_RESOLVER = flags.DEFINE_enum(
    "cluster_resolver", "tf_config", list(strategies_lib.CLUSTER_RESOLVERS),
    "Where the cluster comes from for multi-worker strategies.")
MODEL = flags.DEFINE_enum(
    "model", "convnet", list(models_lib.available_models()), "Model to train.")
DATASET = flags.DEFINE_enum(
    "dataset", "digits", list(data_lib.available_datasets()),
    "Dataset; 'digits' ships offline.")
DATA_PATH = flags.DEFINE_string(
    "data_path", None, ".npz file (x_train, y_train, x_test, y_test) for "
    "--dataset=npz, or a local copy of a downloadable dataset.")
GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 64, "Examples per step over all replicas.",
    lower_bound=1)
MIXED_PRECISION = flags.DEFINE_enum(
    "mixed_precision", "float32", list(models_lib.MIXED_PRECISION_POLICIES),
    "Keras dtype policy; mixed_float16 adds loss scaling.")
STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", 10, "Steps per tf.function call.", lower_bound=1)
JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False, "XLA-compile each replica's forward/backward.")
FUSED_OPTIMIZER = flags.DEFINE_bool(
    "fused_optimizer", True, "Update each variable with one fused kernel "
    "(adam, adamw, sgd, momentum); false: Keras's per-op update.")
INPUT_MODE = flags.DEFINE_enum(
    "input_mode", "auto", list(config_lib.INPUT_MODE_CHOICES),
    "device: hold the training arrays on each replica's device and gather "
    "batches there; tf_data: a tf.data pipeline; auto: device on one host "
    f"when all replicas' copies take <= {config_lib.DEVICE_DATA_MAX_MIB} MiB.")
SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and data order.")
NUM_STAGES = flags.DEFINE_integer(
    "num_stages", 2, "Stages for model_parallel/pipeline.", lower_bound=1)
PARTITION = flags.DEFINE_enum(
    "partition", "balanced", list(config_lib.PARTITION_CHOICES),
    "Cost that stages are balanced by.")
SPLIT_POINTS = flags.DEFINE_list(
    "split_points", None, "Explicit stage boundaries (layer names).")
MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", 4, "Micro-batches per step for 'pipeline'.", lower_bound=1)
SCHEDULE = flags.DEFINE_enum(
    "schedule", "gpipe", list(config_lib.SCHEDULE_CHOICES),
    "Pipeline schedule.")
RECOMPUTE = flags.DEFINE_bool(
    "recompute", False, "Pipeline: recompute activations in the backward.")
VERBOSE = flags.DEFINE_integer("verbose", 1, "1: progress bar; 0: log lines.")
@flags.multi_flags_validator(
    ["global_batch_size", "virtual_devices", "strategy", "num_replicas"],
    message="--global_batch_size must be divisible by the replica count.")
def batch_divisible(values) -> bool:
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
