"""`--steps_per_execution`: steps (or batches) per `tf.function` call."""

from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(TrainConfig, ["steps_per_execution"],
                                   module_name=__name__)
STEPS_PER_EXECUTION = _FLAGS["steps_per_execution"]
