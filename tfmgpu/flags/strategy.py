"""`--strategy` and the options that choose its replica devices."""

from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(
    TrainConfig, ["strategy", "devices", "num_gpus", "num_replicas",
                  "cross_device_ops", "num_packs", "single_replica",
                  "zero_stage"],
    module_name=__name__)
STRATEGY = _FLAGS["strategy"]


def values() -> dict:
  """The group's parsed values, by option name."""
  return flags_lib.values_of(_FLAGS)
