"""Named device links and device speeds: the numbers a cost model assumes.

`LINK_GBPS` gives the nominal unidirectional bandwidth of one device's link,
in GB/s (10^9 bytes); real all-reduce bus bandwidth is typically 70-90% of
these. `GPU_LINKS` are the GPU hosts' links (the benchmark's projection
takes these); `"cpu"` is the copy between logical CPU devices of one process
(host memory, a rough figure). `DEVICE_FLOPS` is a sustained training rate
per device kind, `TASK_OVERHEAD_S` the fixed cost of one forward or
backward, and `DEFAULT_DEVICE_MEMORY_GB` the memory budget assumed when none
is given. All are assumptions for predictions, not measurements.

Pure Python: importing this module does not import TensorFlow, so flags can
list the link names before TensorFlow loads.
"""

from __future__ import annotations

# Unidirectional per-GPU link bandwidth in GB/s (nominal).
GPU_LINKS = {
    "pcie3": 12.0,
    "pcie4": 24.0,
    "nvlink_v100": 150.0,
    "nvlink_a100": 300.0,
    "nvlink_h100": 450.0,
}

# Every named link: the GPU ones, and copies between logical CPU devices.
LINK_GBPS = {**GPU_LINKS, "cpu": 10.0}

# `--link=auto`: PCIe 4 between GPUs (hosts with NVLink name theirs), host
# memory between logical CPUs.
AUTO_LINK = {"GPU": "pcie4", "CPU": "cpu"}

# Sustained training FLOP/s of one device, by kind (assumed: an A100-class
# GPU at about a third of its 16-bit peak; one logical CPU device).
DEVICE_FLOPS = {"GPU": 100e12, "CPU": 50e9}

# Fixed time of each forward or backward a device runs (kernel launches,
# a transfer's latency), by kind: what makes many tiny micro-batches slower.
TASK_OVERHEAD_S = {"GPU": 50e-6, "CPU": 200e-6}

# The per-device memory budget when none is given (GB, 10^9 bytes).
DEFAULT_DEVICE_MEMORY_GB = 16.0

LINK_CHOICES = ("auto",) + tuple(LINK_GBPS)


def link_bandwidth(link: str, device_kind: str = "GPU") -> tuple[str, float]:
  """The link's name (`"auto"` resolved for `device_kind`) and its bandwidth
  in bytes/s.

  Raises:
    ValueError: an unknown link name, listing the known ones.
  """
  name = AUTO_LINK.get(device_kind, "pcie4") if link == "auto" else link
  if name not in LINK_GBPS:
    raise ValueError(f"link={link!r} is unknown. Choose one of "
                     f"{', '.join(LINK_CHOICES)}.")
  return name, LINK_GBPS[name] * 1e9
