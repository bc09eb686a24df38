"""Named device links and device speeds: the numbers a cost model assumes.

`LINK_GBPS` gives the nominal unidirectional bandwidth of one device's link,
in GB/s (10^9 bytes); real all-reduce bus bandwidth is typically 70-90% of
these. `GPU_LINKS` are the GPU hosts' links (the benchmark's projection
takes these); `"cpu"` is the copy between logical CPU devices of one process
(host memory, a rough figure). `DEVICE_FLOPS` is a sustained training rate
per device kind, `TASK_OVERHEAD_S` the fixed cost of one forward or
backward, and `DEFAULT_DEVICE_MEMORY_GB` the memory budget assumed when none
is given. `NETWORK_GBPS` names links between hosts and `GPU_HOSTS` named
GPU hosts (`Host`: GPUs, memory, sustained FLOP/s, the link inside the host
and the network between hosts), what the hybrid accounting
(`tfmgpu.parallel.accounting`) projects a layout's step on. All are
assumptions for predictions, not measurements.

Pure Python: importing this module does not import TensorFlow, so flags can
list the link names before TensorFlow loads.
"""

from __future__ import annotations

import dataclasses

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


# Network bandwidth per GPU between hosts, GB/s (nominal, unidirectional):
# one InfiniBand HDR (200 Gb/s) or NDR (400 Gb/s) adapter per GPU, as DGX
# hosts have, or one 100 Gb/s Ethernet port shared by a host's 8 GPUs.
NETWORK_GBPS = {
    "ib_hdr": 25.0,
    "ib_ndr": 50.0,
    "eth100_shared8": 12.5 / 8,
}


@dataclasses.dataclass(frozen=True)
class Host:
  """A named GPU host: what a layout's step is projected on.

  Attributes:
    name: the host's name (`GPU_HOSTS` key).
    gpus: GPUs in one host.
    memory_gb: memory of each GPU, GB (10^9 bytes).
    flops_per_s: sustained training FLOP/s of one GPU (assumed: about a
      third of its dense 16-bit peak), not a measurement.
    link: the link between GPUs of one host (a `GPU_LINKS` name); tensor
      groups are placed inside one host, on it.
    network: the link between hosts (a `NETWORK_GBPS` name), per GPU.
  """
  name: str
  gpus: int
  memory_gb: float
  flops_per_s: float
  link: str
  network: str

  @property
  def link_bytes_per_s(self) -> float:
    return GPU_LINKS[self.link] * 1e9

  @property
  def network_bytes_per_s(self) -> float:
    return NETWORK_GBPS[self.network] * 1e9


GPU_HOSTS = {h.name: h for h in (
    # 8 x A100 80 GB SXM, NVLink 3 through NVSwitch; 312 TFLOP/s bf16 peak.
    Host("dgx_a100", 8, 80.0, 100e12, "nvlink_a100", "ib_hdr"),
    # 8 x H100 80 GB SXM, NVLink 4 through NVSwitch; ~990 TFLOP/s bf16 peak.
    Host("dgx_h100", 8, 80.0, 330e12, "nvlink_h100", "ib_ndr"),
    # 8 x A10 24 GB on PCIe 4 (no NVLink); 125 TFLOP/s bf16 peak.
    Host("pcie_a10x8", 8, 24.0, 40e12, "pcie4", "eth100_shared8"),
)}


def host(name: str) -> Host:
  """The named GPU host.

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  if name not in GPU_HOSTS:
    raise ValueError(f"host={name!r} is unknown. Choose one of "
                     f"{', '.join(GPU_HOSTS)}.")
  return GPU_HOSTS[name]
