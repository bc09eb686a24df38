"""Find devices, split a CPU or GPU into logical devices, and set GPU memory growth.

TensorFlow fixes its device layout the first time its runtime starts (the
first op, the first strategy, the first `list_logical_devices`). Everything in
this module that changes the layout must therefore run first; afterwards it
raises `DeviceConfigurationError` with what to do, never a silent no-op.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from absl import logging
import tensorflow as tf

from tfmgpu import _compat


class DeviceConfigurationError(RuntimeError):
  """The requested device layout cannot be applied in this process."""


_RESTART_HINT = (
    "Call tfmgpu.configure_devices(...) before any other TensorFlow work "
    "(in a notebook: restart the kernel and call it in the first cell).")


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
  """What the process sees after `configure_devices`.

  Attributes:
    cpus: logical CPU device names, e.g. `("/device:CPU:0",)`.
    gpus: logical GPU device names (empty on a machine without GPUs).
    physical_gpus: number of physical GPUs TensorFlow found.
    memory_growth: whether GPU memory growth is on for every physical GPU.
  """
  cpus: tuple[str, ...]
  gpus: tuple[str, ...]
  physical_gpus: int
  memory_growth: bool

  @property
  def accelerators(self) -> tuple[str, ...]:
    """The devices replicas go on by default: GPUs if any, else the CPUs."""
    return self.gpus or self.cpus


def runtime_initialized() -> bool:
  """Whether TensorFlow's runtime (and so its device layout) has started."""
  return _compat.runtime_initialized()


def _split(device: tf.config.PhysicalDevice, count: int,
           memory_limit_mb: int | None, what: str) -> None:
  """Splits one physical device into `count` logical ones, idempotently."""
  if memory_limit_mb is None:
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
  else:
    wanted = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
              for _ in range(count)]
  current = tf.config.get_logical_device_configuration(device)
  kind = device.device_type
  if runtime_initialized():
    have = len(current) if current else len(
        [d for d in tf.config.list_logical_devices(kind)])
    if have == count:
      return  # Same request again: nothing to do.
    raise DeviceConfigurationError(
        f"{what}={count} cannot be applied: TensorFlow is already initialised "
        f"with {have} logical {kind} device(s). {_RESTART_HINT}")
  if current is not None and len(current) == count:
    return
  try:
    tf.config.set_logical_device_configuration(device, wanted)
  except RuntimeError as e:  # Initialised between our check and the call.
    raise DeviceConfigurationError(
        f"{what}={count} cannot be applied: {e}. {_RESTART_HINT}") from e


def cpu_cores() -> int:
  """Cores this process may run on (its affinity mask, where known)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    return os.cpu_count() or 1


def _share_cores(logical_cpus: int | None, intra_op_threads: int | None) -> None:
  """Sets TF's threads per op for a CPU split into `logical_cpus` devices.

  Replicas on logical CPUs run their ops at the same time; with TF's default
  (every op may use every core) they oversubscribe the cores. `None` gives
  each op `cores // logical_cpus` threads (at least 1) when the CPU is split
  and the user has not chosen a number; `0` leaves TensorFlow's setting as
  it is (unset: every core per op).
  """
  explicit = intra_op_threads is not None
  if not explicit:
    if (logical_cpus or 1) < 2 or (
        tf.config.threading.get_intra_op_parallelism_threads()):
      return
    intra_op_threads = max(1, cpu_cores() // logical_cpus)
  if not intra_op_threads or (
      tf.config.threading.get_intra_op_parallelism_threads()
      == intra_op_threads):
    return
  if runtime_initialized():
    if not explicit:
      logging.info("TensorFlow already runs with its own threads per op; "
                   "not changing them to %d for %d logical CPUs.",
                   intra_op_threads, logical_cpus)
      return
    raise DeviceConfigurationError(
        f"intra_op_threads={intra_op_threads} cannot be applied: TensorFlow "
        f"is already initialised. {_RESTART_HINT}")
  tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
  logging.info("Intra-op threads per op: %d (%d cores, %s logical CPUs).",
               intra_op_threads, cpu_cores(), logical_cpus or 1)


def configure_devices(*,
                      logical_cpus: int | None = None,
                      logical_gpus: int | None = None,
                      gpu_memory_limit_mb: int = 1024,
                      memory_growth: bool = False,
                      intra_op_threads: int | None = None) -> DeviceLayout:
  """Configures the process's device layout; call it before other TF work.

  Calling it again with the same request is a no-op, so a notebook cell that
  calls it can be re-run.

  Args:
    logical_cpus: split the CPU into this many logical devices (to test and
      demonstrate multi-device code without GPUs). `None` leaves it alone.
    logical_gpus: split the first GPU into this many logical GPUs of
      `gpu_memory_limit_mb` each. `None` leaves GPUs alone.
    gpu_memory_limit_mb: memory per logical GPU. Defaults to `1024`.
    memory_growth: allocate GPU memory as needed instead of all at once.
      On a machine without GPUs this logs that there is nothing to do.
    intra_op_threads: threads one op may use. `None` (the default): when
      `logical_cpus` >= 2 and TensorFlow's own setting is untouched, each op
      gets `cores // logical_cpus` threads (at least 1), so replicas running
      at once share the cores instead of oversubscribing them
      (docs/benchmarks.md measures the difference).
      `0` leaves TensorFlow's setting as it is (unset: every core per op),
      for work whose devices run one after another.

  Returns:
    The resulting `DeviceLayout`.

  Raises:
    ValueError: a count below 1, or GPUs requested on a machine without any.
    DeviceConfigurationError: TensorFlow is already initialised with a
      different layout.
  """
  _check_request(logical_cpus, logical_gpus, gpu_memory_limit_mb,
                 intra_op_threads)
  physical_gpus = tf.config.list_physical_devices("GPU")
  if logical_cpus is not None:
    _split(tf.config.list_physical_devices("CPU")[0], logical_cpus, None,
           "logical_cpus")
  _share_cores(logical_cpus, intra_op_threads)
  if logical_gpus is not None:
    if not physical_gpus:
      raise ValueError(
          f"logical_gpus={logical_gpus} was requested but TensorFlow found no "
          f"GPU. Use logical_cpus={logical_gpus} to simulate devices on the "
          "CPU (CLI: --virtual_devices).")
    if memory_growth:
      raise ValueError(
          "memory_growth=True cannot be combined with logical_gpus: TensorFlow "
          "needs a fixed memory limit per logical GPU. Drop one of the two.")
    _split(physical_gpus[0], logical_gpus, gpu_memory_limit_mb, "logical_gpus")
  growth = memory_growth and _grow_memory(physical_gpus)
  return current_layout(memory_growth=growth)


def _check_request(logical_cpus: int | None, logical_gpus: int | None,
                   gpu_memory_limit_mb: int,
                   intra_op_threads: int | None) -> None:
  """Validates `configure_devices`' counts; raises `ValueError`."""
  for name, value in (("logical_cpus", logical_cpus),
                      ("logical_gpus", logical_gpus)):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"{name}={value!r} must be a positive integer.")
  if gpu_memory_limit_mb < 1:
    raise ValueError(f"gpu_memory_limit_mb={gpu_memory_limit_mb} must be >= 1.")
  if intra_op_threads is not None and (
      not isinstance(intra_op_threads, int) or intra_op_threads < 0):
    raise ValueError(f"intra_op_threads={intra_op_threads!r} must be an "
                     "integer >= 0 (0: leave TensorFlow's setting).")


def _grow_memory(physical_gpus: Sequence[tf.config.PhysicalDevice]) -> bool:
  """Turns on memory growth for every GPU; returns whether there are any."""
  if not physical_gpus:
    logging.info("memory_growth: no GPU found, nothing to do.")
    return False
  for gpu in physical_gpus:
    if tf.config.experimental.get_memory_growth(gpu):
      continue
    try:
      tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as e:
      raise DeviceConfigurationError(
          f"memory_growth=True cannot be applied: {e}. {_RESTART_HINT}"
      ) from e
  return True


def configure_virtual_devices(count: int | None, *,
                              intra_op_threads: int | None = None
                              ) -> DeviceLayout:
  """Splits the accelerator into `count` logical devices (GPU if any, else CPU).

  This is what the CLI's `--virtual_devices` does: the same flag simulates a
  multi-GPU host on a laptop and splits a real GPU on a workstation.

  Args:
    count: number of logical devices; `None` or `0` changes nothing.
    intra_op_threads: see `configure_devices` (CPU splits only).

  Returns:
    The resulting `DeviceLayout`.
  """
  if not count:
    return current_layout()
  if tf.config.list_physical_devices("GPU"):
    return configure_devices(logical_gpus=count)
  return configure_devices(logical_cpus=count,
                           intra_op_threads=intra_op_threads)


def split_virtual_devices(count: int | None) -> None:
  """Like `configure_virtual_devices`, but leaves TensorFlow's runtime unstarted.

  Strategies that join a cluster (`multi_worker_mirrored`,
  `parameter_server`) configure the runtime themselves when they are created
  ("collective ops must be configured at program startup"), so
  `run_training` splits the devices with this, creates the strategy, and only
  then reads the layout.

  Args:
    count: number of logical devices; `None` or `0` changes nothing.

  Raises:
    DeviceConfigurationError: the runtime already started with another layout.
  """
  if not count:
    return
  gpus = tf.config.list_physical_devices("GPU")
  if gpus:
    _split(gpus[0], count, 1024, "logical_gpus")
  else:
    _split(tf.config.list_physical_devices("CPU")[0], count, None,
           "logical_cpus")
    _share_cores(count, None)


def current_layout(*, memory_growth: bool | None = None) -> DeviceLayout:
  """Returns the logical devices TensorFlow exposes (initialises the runtime)."""
  physical_gpus = tf.config.list_physical_devices("GPU")
  if memory_growth is None:
    memory_growth = bool(physical_gpus) and all(
        tf.config.experimental.get_memory_growth(g) for g in physical_gpus)
  return DeviceLayout(
      cpus=tuple(d.name for d in tf.config.list_logical_devices("CPU")),
      gpus=tuple(d.name for d in tf.config.list_logical_devices("GPU")),
      physical_gpus=len(physical_gpus),
      memory_growth=memory_growth)


def list_devices(device_type: str | None = None) -> list[str]:
  """Lists logical device names, e.g. `['/device:CPU:0', '/device:CPU:1']`.

  Args:
    device_type: `"CPU"`, `"GPU"`, `"TPU"` or `None` for all.

  Returns:
    Logical device names in TensorFlow's order.
  """
  return [d.name for d in tf.config.list_logical_devices(device_type)]


def accelerator_devices() -> list[str]:
  """The devices replicas and stages go on by default: GPUs, else CPUs."""
  return list(current_layout().accelerators)


def canonical_device(name: str) -> str:
  """Normalises `'/gpu:1'`, `'GPU:1'` or `'/device:GPU:1'` to `'/device:GPU:1'`."""
  spec = tf.DeviceSpec.from_string(name if name.startswith("/") else "/" + name)
  if spec.device_type is None:
    raise ValueError(f"device={name!r} names no device type; use e.g. '/gpu:0'.")
  return f"/device:{spec.device_type.upper()}:{spec.device_index or 0}"


def resolve_devices(devices: Sequence[str]) -> list[str]:
  """Validates device names against the logical devices that exist.

  Raises:
    ValueError: a device that does not exist, naming the ones found.
  """
  found = list_devices()
  out = []
  for d in devices:
    c = canonical_device(d)
    if c not in found:
      raise ValueError(
          f"device {d!r} does not exist here. Devices found: "
          f"{', '.join(found)}. To simulate more, call "
          "tfmgpu.configure_devices(logical_cpus=N) first (CLI: "
          "--virtual_devices=N).")
    out.append(c)
  return out
