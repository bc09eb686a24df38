"""What a machine has, as plain data: software, GPUs, CPU, cluster, devices.

`tfmgpu.diagnostics.probe.collect()` fills a `MachineReport` for this
machine; a report for a machine you do not have (8 GPUs of compute
capability 8.0, say) is a plain constructor call away, and
`tfmgpu.diagnostics.recommendations.recommend` reads nothing else.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuInfo:
  """One physical GPU as TensorFlow sees it.

  Attributes:
    index: TensorFlow's GPU index (`/physical_device:GPU:<index>`).
    name: e.g. `"NVIDIA A100-SXM4-80GB"`, or `"unknown"`.
    compute_capability: `(major, minor)`, or `None` if TF cannot tell.
    memory_mb: total memory from nvidia-smi, or `None` if unknown.
  """
  index: int
  name: str = "unknown"
  compute_capability: tuple[int, int] | None = None
  memory_mb: int | None = None


@dataclasses.dataclass(frozen=True)
class CpuInfo:
  """The host CPU and memory.

  Attributes:
    model: model name from /proc/cpuinfo, or `None`.
    cores: logical cores in the machine (`os.cpu_count()`).
    usable_cores: cores this process may run on (its CPU affinity).
    memory_mb: total RAM, or `None` if unknown.
    avx512_bf16: the CPU has AVX512-BF16 instructions.
    amx_bf16: the CPU has AMX tiles with bfloat16 (Sapphire Rapids and later).
    onednn: TensorFlow's oneDNN CPU kernels are on (`TF_ENABLE_ONEDNN_OPTS`,
      else TensorFlow's default for this CPU); `None`: unknown.
  """
  model: str | None = None
  cores: int | None = None
  usable_cores: int | None = None
  memory_mb: int | None = None
  avx512_bf16: bool = False
  amx_bf16: bool = False
  onednn: bool | None = None


@dataclasses.dataclass(frozen=True)
class TfConfigSummary:
  """`TF_CONFIG`, parsed and validated (see `summarize_tf_config`).

  Attributes:
    jobs: job name -> number of tasks, e.g. `{"worker": 2}`; empty if invalid.
    task_type: this process's job, e.g. `"worker"`.
    task_index: this process's index in its job.
    error: why `TF_CONFIG` is invalid, or `None` if it is valid.
  """
  jobs: dict[str, int] = dataclasses.field(default_factory=dict)
  task_type: str | None = None
  task_index: int | None = None
  error: str | None = None

  @property
  def valid(self) -> bool:
    return self.error is None


@dataclasses.dataclass(frozen=True)
class MachineReport:
  """Everything `recommend` needs to know about a machine.

  Attributes:
    python_version: e.g. `"3.11.7"`.
    platform: `sys.platform`, e.g. `"linux"`.
    tensorflow_version: e.g. `"2.21.0"`.
    keras_version: e.g. `"3.15.1"`, or `None` if Keras is missing.
    keras_backend: Keras' backend, e.g. `"tensorflow"`.
    built_with_cuda: TensorFlow was built with CUDA.
    cuda_version: CUDA version TF was built with, e.g. `"12.5.1"`.
    cudnn_version: cuDNN version TF was built with, e.g. `"9"`.
    cuda_compute_capabilities: what the build targets, e.g. `("sm_80",)`.
    gpus: the GPUs TensorFlow sees.
    driver_version: NVIDIA driver version from nvidia-smi, or `None`.
    driver_gpus: GPUs nvidia-smi lists (all of them, whatever
      `CUDA_VISIBLE_DEVICES` says), or `None` without nvidia-smi.
    cpu: the host CPU and memory.
    tf_config: `TF_CONFIG` summary, or `None` if unset.
    environment: relevant variables (`CUDA_VISIBLE_DEVICES`, `SLURM_*`, ...).
    logical_devices: logical device names, e.g. `("/device:CPU:0",)`.
    runtime_initialized: whether TF's runtime had started. If not,
      `logical_devices` is what the current configuration will create.
  """
  python_version: str = ""
  platform: str = "linux"
  tensorflow_version: str = ""
  keras_version: str | None = None
  keras_backend: str | None = "tensorflow"
  built_with_cuda: bool = False
  cuda_version: str | None = None
  cudnn_version: str | None = None
  cuda_compute_capabilities: tuple[str, ...] = ()
  gpus: tuple[GpuInfo, ...] = ()
  driver_version: str | None = None
  driver_gpus: int | None = None
  cpu: CpuInfo = CpuInfo()
  tf_config: TfConfigSummary | None = None
  environment: dict[str, str] = dataclasses.field(default_factory=dict)
  logical_devices: tuple[str, ...] = ()
  runtime_initialized: bool = False

  @property
  def num_gpus(self) -> int:
    return len(self.gpus)

  @property
  def nccl_usable(self) -> bool:
    """NCCL all-reduce can work: Linux, a CUDA build and 2+ GPUs."""
    return not self.nccl_status()[1]

  def nccl_status(self) -> tuple[str, str]:
    """Returns `("usable" or "not usable", why not or "")`."""
    if not self.platform.startswith("linux"):
      why = f"NCCL ships for Linux only (platform is {self.platform})"
    elif not self.built_with_cuda:
      why = "TensorFlow was built without CUDA"
    elif self.num_gpus < 2:
      why = f"it needs 2+ GPUs and {self.num_gpus} found"
    else:
      return "usable", ""
    return "not usable", why

  @property
  def slurm_tasks(self) -> int | None:
    """Tasks of the enclosing SLURM job (`SLURM_NTASKS`), or `None`."""
    raw = self.environment.get("SLURM_NTASKS") or self.environment.get(
        "SLURM_NPROCS")
    return int(raw) if raw and raw.isdigit() else None
