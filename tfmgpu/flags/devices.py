"""`--virtual_devices`: split the GPU (else the CPU) into logical devices."""

from absl import flags

VIRTUAL_DEVICES = flags.DEFINE_integer(
    "virtual_devices", None, "Split the GPU (else the CPU) into this many "
    "logical devices first: simulates a multi-device host.", lower_bound=1)
