"""Which devices replicate, and how their gradients are all-reduced.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from tfmgpu import checks
from tfmgpu._lazy import LazyModule

tf = LazyModule("tensorflow")
_compat = LazyModule("tfmgpu._compat")
devices_lib = LazyModule("tfmgpu.devices")


def select_replica_devices(devices: Sequence[str] | None, num_gpus: int | None,
                     num_replicas: int | None) -> list[str]:
  """Chooses the devices a data-parallel strategy replicates over."""
  if devices is not None:
    if not devices:
      raise ValueError("devices=[] is empty; name at least one device.")
    return devices_lib.resolve_devices(devices)
  layout = devices_lib.current_layout()
  if num_gpus is not None:
    if num_gpus < 0 or num_gpus > len(layout.gpus):
      raise ValueError(
          f"num_gpus={num_gpus} but this machine has {len(layout.gpus)} GPU(s). "
          f"Devices found: {', '.join(layout.cpus + layout.gpus)}. "
          + ("Use num_replicas=N with --virtual_devices=N to simulate replicas "
             "on the CPU." if not layout.gpus else
             f"Use num_gpus<={len(layout.gpus)}."))
    return list(layout.gpus[:num_gpus]) or [layout.cpus[0]]
  accel = list(layout.accelerators)
  if num_replicas is not None:
    if num_replicas < 1 or num_replicas > len(accel):
      raise ValueError(
          f"num_replicas={num_replicas} but only {len(accel)} device(s) exist: "
          f"{', '.join(accel)}. Split a device first with "
          "tfmgpu.configure_devices(logical_cpus=N) (CLI: --virtual_devices=N).")
    return accel[:num_replicas]
  return accel


def _is_gpu(device: str) -> bool:
  return tf.DeviceSpec.from_string(device).device_type == "GPU"


# ------------------------------------------------------ cross-device ops

_CROSS_DEVICE_OPS: dict[str, Callable[[int], "tf.distribute.CrossDeviceOps"]] = {
    "nccl": lambda packs: tf.distribute.NcclAllReduce(num_packs=packs),
    "hierarchical_copy":
        lambda packs: tf.distribute.HierarchicalCopyAllReduce(num_packs=packs),
    "reduction_to_one": lambda packs: tf.distribute.ReductionToOneDevice(),
}
CROSS_DEVICE_OPS_CHOICES = ("auto",) + tuple(_CROSS_DEVICE_OPS)


def choose_cross_device_ops(name: str, replica_devices: Sequence[str]) -> str:
  """Resolves `auto` and checks a choice against the replica devices.

  `auto` picks NCCL only when every replica is a GPU (NCCL kernels exist only
  for GPUs); otherwise `reduction_to_one`, which also lets strategies with
  different replica counts live in one process (TF's default CPU collectives
  do not).

  Raises:
    ValueError: unknown name, or NCCL with a non-GPU replica.
  """
  checks.check_choice("cross_device_ops", name, CROSS_DEVICE_OPS_CHOICES)
  all_gpu = bool(replica_devices) and all(_is_gpu(d) for d in replica_devices)
  if name == "auto":
    return "nccl" if all_gpu and len(replica_devices) > 1 else "reduction_to_one"
  if name == "nccl" and not all_gpu:
    raise ValueError(
        "cross_device_ops='nccl' needs every replica on a GPU, but replicas are "
        f"on {', '.join(replica_devices)}: NCCL has no CPU kernel and would "
        "fail at the first step. Use cross_device_ops='auto' or "
        "'reduction_to_one'.")
  return name


def make_cross_device_ops(name: str, replica_devices: Sequence[str],
                          num_packs: int = 1) -> tf.distribute.CrossDeviceOps:
  """Builds the cross-device ops object for `name` (see `choose_cross_device_ops`)."""
  if num_packs < 1:
    raise ValueError(f"num_packs={num_packs} must be >= 1.")
  return _CROSS_DEVICE_OPS[choose_cross_device_ops(name, replica_devices)](
      num_packs)


def short_device(name: str) -> str:
  """'/job:localhost/replica:0/task:0/device:CPU:1' -> '/device:CPU:1'."""
  return name.replace("/job:localhost/replica:0/task:0", "")


def replica_devices(strategy: "tf.distribute.Strategy") -> list[str]:
  """The devices a strategy's replicas run on, short names."""
  try:
    devices = list(strategy.extended.worker_devices)
  except (AttributeError, RuntimeError):  # The default strategy has none.
    devices = []
  return [short_device(d) for d in devices] or [
      devices_lib.accelerator_devices()[0]]


def in_multi_worker_mode(strategy: "tf.distribute.Strategy") -> bool:
  """Whether `strategy` spans several worker processes (TF has no public
  call for this; see `_compat.in_multi_worker_mode`)."""
  return _compat.in_multi_worker_mode(strategy)
