"""`--device_memory_gb` and `--link`: what `--strategy=auto` plans for."""

from absl import flags

from tfmgpu import flags as flags_lib
from tfmgpu.parallel import links

DEVICE_MEMORY_GB = flags.DEFINE_float(
    "device_memory_gb", None, "'auto': memory budget per device in GB; no "
    "layout whose estimate exceeds it is chosen. Default: "
    f"{links.DEFAULT_DEVICE_MEMORY_GB:g}.", lower_bound=0.001)
LINK = flags_lib.define_choice(
    "link", "auto", list(links.LINK_CHOICES),
    "'auto': the link between devices, for predicted transfer and "
    "all-reduce times (nominal GB/s: "
    + ", ".join(f"{k} {v:g}" for k, v in links.LINK_GBPS.items())
    + "); auto: pcie4 between GPUs, cpu between logical CPUs.",
    module_name=__name__)


def values() -> dict:
  """The group's parsed values, by option name."""
  return {"device_memory_gb": DEVICE_MEMORY_GB.value, "link": LINK.value}
