"""Describe this machine in a `MachineReport`, without starting TensorFlow.

`collect()` reads TensorFlow's build, the GPUs it sees (with nvidia-smi's
memory and driver), the CPU, relevant environment variables, TF_CONFIG and
the logical devices. It imports TensorFlow but never starts its runtime, so
a notebook can call it before `tfmgpu.configure_devices(...)`.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from tfmgpu.diagnostics.report import CpuInfo
from tfmgpu.diagnostics.report import GpuInfo
from tfmgpu.diagnostics.report import MachineReport
from tfmgpu.diagnostics.report import TfConfigSummary

_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES",
    "KERAS_BACKEND", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
    "OMP_NUM_THREADS", "TF_ENABLE_ONEDNN_OPTS", "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_GPU_ALLOCATOR", "TF_XLA_FLAGS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")
_ENV_PREFIXES = ("SLURM_", "NCCL_")


def collect() -> MachineReport:
  """Describes this machine; imports TensorFlow but never starts its runtime.

  Returns:
    A `MachineReport`. Anything that cannot be found is `None` or empty; it
    never raises because a GPU, a driver or a file is missing.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  build = dict(tf.sysconfig.get_build_info())
  environment = {k: v for k, v in os.environ.items()
                 if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}
  driver_version, smi = _nvidia_smi()
  raw_tf_config = os.environ.get("TF_CONFIG")
  logical, initialized = _logical_devices(tf)
  keras_version, keras_backend = _keras()
  return MachineReport(
      python_version=platform.python_version(),
      platform=sys.platform,
      tensorflow_version=tf.__version__,
      keras_version=keras_version,
      keras_backend=keras_backend,
      built_with_cuda=tf.test.is_built_with_cuda(),
      cuda_version=build.get("cuda_version"),
      cudnn_version=build.get("cudnn_version"),
      cuda_compute_capabilities=tuple(build.get("cuda_compute_capabilities",
                                                ())),
      gpus=_gpus(tf, smi, environment.get("CUDA_VISIBLE_DEVICES")),
      driver_version=driver_version,
      driver_gpus=None if smi is None else len(smi),
      cpu=_cpu(),
      tf_config=summarize_tf_config(raw_tf_config) if raw_tf_config else None,
      environment=environment,
      logical_devices=logical,
      runtime_initialized=initialized)


def summarize_tf_config(raw: str) -> TfConfigSummary:
  """Validates a `TF_CONFIG` value as `get_strategy` will, and summarizes it.

  Args:
    raw: the value of the `TF_CONFIG` environment variable.

  Returns:
    A `TfConfigSummary`; if `raw` is invalid, its `error` says why.
  """
  from tfmgpu import strategies  # pylint: disable=g-import-not-at-top
  try:
    cfg = strategies.validate_tf_config(raw)
  except ValueError as e:
    return TfConfigSummary(error=str(e))
  task = cfg.get("task") or {}
  return TfConfigSummary(
      jobs={job: len(tasks) for job, tasks in cfg["cluster"].items()},
      task_type=task.get("type"),
      task_index=task.get("index", 0) if task.get("type") else None)


def _keras() -> tuple[str | None, str | None]:
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None, None
  return keras.__version__, keras.backend.backend()


def _nvidia_smi() -> tuple[str | None, list[dict[str, Any]] | None]:
  """Returns (driver version, one dict per GPU) or (None, None) without it."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return None, None
  fields = "index,uuid,name,memory.total,driver_version"
  try:
    out = subprocess.run(
        [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=20, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None, None
  gpus, driver = [], None
  for line in out.strip().splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5 or not parts[0].isdigit():
      continue
    index, uuid, name, memory, driver = parts
    gpus.append({"index": int(index), "uuid": uuid, "name": name,
                 "memory_mb": int(memory) if memory.isdigit() else None})
  return driver, gpus


def _gpus(tf, smi: list[dict[str, Any]] | None,
          visible: str | None) -> tuple[GpuInfo, ...]:
  tokens = [t.strip() for t in visible.split(",")] if visible else None
  out = []
  for i, device in enumerate(tf.config.list_physical_devices("GPU")):
    try:
      details = tf.config.experimental.get_device_details(device)
    except (ValueError, RuntimeError):
      details = {}
    name = details.get("device_name", "unknown")
    cc = details.get("compute_capability")
    out.append(GpuInfo(index=i, name=name,
                       compute_capability=tuple(cc) if cc else None,
                       memory_mb=_smi_memory(i, name, smi, tokens)))
  return tuple(out)


def _smi_memory(i: int, name: str, smi: list[dict[str, Any]] | None,
                tokens: list[str] | None) -> int | None:
  """Memory of TF's GPU `i` from nvidia-smi, mapped via CUDA_VISIBLE_DEVICES."""
  if not smi:
    return None
  if tokens is None:
    match = [g for g in smi if g["index"] == i]
  elif i < len(tokens) and tokens[i].isdigit():
    match = [g for g in smi if g["index"] == int(tokens[i])]
  elif i < len(tokens):
    match = [g for g in smi if g["uuid"].startswith(tokens[i])]
  else:
    match = []
  # nvidia-smi orders by PCI bus, CUDA may not: trust a match by name only.
  if len(match) == 1 and match[0]["name"] == name:
    return match[0]["memory_mb"]
  return None


def _cpu() -> CpuInfo:
  model, flags = None, set()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
          model = value.strip()
        elif key == "flags":
          flags = set(value.split())
          break
  except OSError:
    pass
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    usable = os.cpu_count()
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top  (TF)
  return CpuInfo(model=model or platform.processor() or None,
                 cores=os.cpu_count(), usable_cores=usable,
                 memory_mb=_memory_mb(), avx512_bf16="avx512_bf16" in flags,
                 amx_bf16="amx_bf16" in flags,
                 onednn=_compat.onednn_enabled())


def _memory_mb() -> int | None:
  try:
    import psutil  # pylint: disable=g-import-not-at-top
    return psutil.virtual_memory().total // 2**20
  except ImportError:  # psutil is a dev extra only.
    pass
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return int(line.split()[1]) // 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def _logical_devices(tf) -> tuple[tuple[str, ...], bool]:
  """Logical devices, without starting the runtime if it has not started."""
  from tfmgpu import devices  # pylint: disable=g-import-not-at-top
  if devices.runtime_initialized():
    return tuple(d.name for d in tf.config.list_logical_devices()), True
  names, counts = [], {}
  for device in tf.config.get_visible_devices():
    kind = device.device_type
    for _ in tf.config.get_logical_device_configuration(device) or [None]:
      names.append(f"/device:{kind}:{counts.get(kind, 0)}")
      counts[kind] = counts.get(kind, 0) + 1
  return tuple(names), False
