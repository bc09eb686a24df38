"""`--strategy` and the options that choose its replica devices."""

from absl import flags

from tfmgpu import flags as flags_lib
from tfmgpu import strategies as strategies_lib

STRATEGY = flags_lib.define_choice(
    "strategy", "mirrored", list(strategies_lib.available_strategies()),
    "How to spread work over devices; see tfmgpu.available_strategies().",
    module_name=__name__)
DEVICES = flags.DEFINE_list(
    "devices", None, "Explicit replica devices, e.g. /gpu:0,/gpu:1.")
NUM_GPUS = flags.DEFINE_integer(
    "num_gpus", None, "Use the first N GPUs.", lower_bound=0)
NUM_REPLICAS = flags.DEFINE_integer(
    "num_replicas", None, "Use the first N accelerator devices (GPUs, else "
    "logical CPUs).", lower_bound=1)
CROSS_DEVICE_OPS = flags_lib.define_choice(
    "cross_device_ops", "auto", list(strategies_lib.CROSS_DEVICE_OPS_CHOICES),
    "All-reduce implementation for 'mirrored'; auto picks NCCL only when "
    "every replica is a GPU.",
    module_name=__name__)
NUM_PACKS = flags.DEFINE_integer(
    "num_packs", 1, "Gradient packs for all-reduce.", lower_bound=1)
SINGLE_REPLICA = flags_lib.define_choice(
    "single_replica", "default", list(strategies_lib.SINGLE_REPLICA_CHOICES),
    "'mirrored' with one replica: 'default' skips MirroredStrategy's "
    "overhead; 'mirrored' keeps it.",
    module_name=__name__)

ZERO_STAGE = flags.DEFINE_integer(
    "zero_stage", 0, "'mirrored': shard state over the replicas (ZeRO): 1 "
    "optimizer slots, 2 also gradients, 3 also weights; 0 whole copies.",
    lower_bound=0, upper_bound=3)


def values() -> dict:
  """The group's parsed values, by option name."""
  return {"strategy": STRATEGY.value,
          "devices": tuple(DEVICES.value) if DEVICES.value else None,
          "num_gpus": NUM_GPUS.value, "num_replicas": NUM_REPLICAS.value,
          "cross_device_ops": CROSS_DEVICE_OPS.value,
          "num_packs": NUM_PACKS.value,
          "single_replica": SINGLE_REPLICA.value,
          "zero_stage": ZERO_STAGE.value}
