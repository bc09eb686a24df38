"""`--device_memory_gb` and `--link`: what `--strategy=auto` plans for."""

from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(TrainConfig, ["device_memory_gb", "link"],
                                   module_name=__name__)

