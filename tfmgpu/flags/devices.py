"""`--virtual_devices`: split the GPU (else the CPU) into logical devices."""

from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(TrainConfig, ["virtual_devices"],
                                   module_name=__name__)
VIRTUAL_DEVICES = _FLAGS["virtual_devices"]
