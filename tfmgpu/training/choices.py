"""The training engine's choice lists, importable without TensorFlow.

`tfmgpu.config`, the CLI flags and the engine modules read these names from
here, so a choice is added in one place (and `--help` answers before
TensorFlow loads). The optimizer names are the keys of
`tfmgpu.training.optimizers`' registry.
"""

from __future__ import annotations

# Dtypes gradients can travel in (`tfmgpu.training.allreduce`).
COMPRESSION_CHOICES = ("none", "float16", "bfloat16")

# Where training batches come from (`tfmgpu.training.resident`): `auto` holds
# the training arrays on the devices when all replicas' copies together take
# at most DEVICE_DATA_MAX_MIB.
INPUT_MODE_CHOICES = ("auto", "device", "tf_data")
DEVICE_DATA_MAX_MIB = 512
