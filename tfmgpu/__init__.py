"""tfmgpu: train and serve Keras models on many devices."""

from tfmgpu.devices import DeviceConfigurationError
from tfmgpu.devices import DeviceLayout
from tfmgpu.devices import configure_devices
from tfmgpu.devices import configure_virtual_devices
from tfmgpu.devices import list_devices
from tfmgpu.strategies import available_strategies
from tfmgpu.strategies import get_strategy

__version__ = "0.1.0"
