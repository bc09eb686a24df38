"""How a model is cut into stages (model_parallel, pipeline, branches), and
the sizes of hybrid layouts."""

from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(
    TrainConfig, ["num_stages", "partition", "split_points", "micro_batches",
                  "data_parallel", "tensor_parallel", "tensor_rules"],
    module_name=__name__)


def values() -> dict:
  """The group's parsed values, by option name."""
  return flags_lib.values_of(_FLAGS)
