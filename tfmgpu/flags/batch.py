"""`--global_batch_size`: examples per step over all replicas."""

from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(TrainConfig, ["global_batch_size"],
                                   module_name=__name__)
GLOBAL_BATCH_SIZE = _FLAGS["global_batch_size"]
