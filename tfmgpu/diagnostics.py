"""What this machine has, and how tfmgpu should train on it.

`collect()` describes the machine in a frozen `MachineReport` (software, GPUs,
CPU, cluster environment, logical devices). `recommend()` turns a report, and
nothing else, into `Recommendations`: a strategy, cross-device ops, a mixed
precision policy and the command line to start with, each with its reason.
Because recommendations depend only on the report, a report for a machine you
do not have (8 GPUs of compute capability 8.0, say) is a plain constructor
call away. `python -m tfmgpu.doctor` prints both.

Importing this module does not import TensorFlow; `collect()` does. It never
starts TensorFlow's runtime either, so a notebook can call it before
`tfmgpu.configure_devices(...)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

_TRAIN = "python -m tfmgpu.train"
_TEST_REPLICAS = 2  # Logical devices for the multi-device test command.
_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES",
    "KERAS_BACKEND", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
    "OMP_NUM_THREADS", "TF_ENABLE_ONEDNN_OPTS", "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_GPU_ALLOCATOR", "TF_XLA_FLAGS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")
_ENV_PREFIXES = ("SLURM_", "NCCL_")


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
  """
  model: str | None = None
  cores: int | None = None
  usable_cores: int | None = None
  memory_mb: int | None = None
  avx512_bf16: bool = False
  amx_bf16: bool = False


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


@dataclasses.dataclass(frozen=True)
class Recommendation:
  """A value to use and the short reason for it."""
  value: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Recommendations:
  """What to run on a machine, derived from its `MachineReport` only.

  Attributes:
    strategy: a `--strategy` name.
    cross_device_ops: a `--cross_device_ops` choice for all-reduce between
      this host's devices (used on the command line only with `mirrored`).
    mixed_precision: a Keras dtype policy; `"float32"` means none.
    command: the command line to start with.
    test_command: a command that exercises multi-device code on logical
      devices of this machine, or `None` when real devices already do.
    notes: further advice.
    problems: what is missing or misconfigured.
  """
  strategy: Recommendation
  cross_device_ops: Recommendation
  mixed_precision: Recommendation
  command: str
  test_command: str | None = None
  notes: tuple[str, ...] = ()
  problems: tuple[str, ...] = ()


# ---------------------------------------------------------------- collect

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
  return CpuInfo(model=model or platform.processor() or None,
                 cores=os.cpu_count(), usable_cores=usable,
                 memory_mb=_memory_mb(), avx512_bf16="avx512_bf16" in flags,
                 amx_bf16="amx_bf16" in flags)


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
  if devices._runtime_initialized():  # pylint: disable=protected-access
    return tuple(d.name for d in tf.config.list_logical_devices()), True
  names, counts = [], {}
  for device in tf.config.get_visible_devices():
    kind = device.device_type
    for _ in tf.config.get_logical_device_configuration(device) or [None]:
      names.append(f"/device:{kind}:{counts.get(kind, 0)}")
      counts[kind] = counts.get(kind, 0) + 1
  return tuple(names), False


# -------------------------------------------------------------- recommend

def recommend(report: MachineReport, *,
              model_memory_gb: float | None = None) -> Recommendations:
  """Chooses strategy, cross-device ops, precision and a command line.

  Args:
    report: a `MachineReport`, from `collect()` or built by hand.
    model_memory_gb: memory one replica of the model needs to train (weights,
      gradients, optimizer state and activations), if known. When it exceeds
      one GPU, a placement (`pipeline` / `model_parallel`) is recommended.
      Defaults to `None` (assume the model fits).

  Returns:
    `Recommendations`; never raises for a machine without GPUs.

  Raises:
    ValueError: `model_memory_gb` is not positive.
  """
  if model_memory_gb is not None and model_memory_gb <= 0:
    raise ValueError(f"model_memory_gb={model_memory_gb} must be > 0 (GiB).")
  n = report.num_gpus
  problems, notes = _problems(report), []
  ops = _cross_device_ops(report)
  precision = _mixed_precision(report)
  mp = None if precision.value == "float32" else precision.value
  cluster = _cluster(report)
  smallest = min((g.memory_mb for g in report.gpus if g.memory_mb),
                 default=None)
  too_big = bool(model_memory_gb and smallest
                 and model_memory_gb * 1024 > smallest)
  test_command = None
  if cluster is not None:
    strategy = cluster
    command = _command(cluster.value, mixed_precision=mp)
    notes.append("Run the same command in every task of the cluster.")
  elif n == 0:
    strategy = Recommendation(
        "default", "no GPU: one device runs everything (one_device is the "
        "same on a CPU). Logical CPUs (--virtual_devices) test multi-device "
        "code; they share the cores, so they prove correctness, not speed.")
    command = _command("default")
    test_command = _command("mirrored", virtual_devices=_TEST_REPLICAS,
                            cross_device_ops=ops.value)
  elif n == 1:
    strategy = Recommendation(
        "one_device", "one GPU: no replicas to synchronise; model_parallel "
        "and pipeline would only add copies on a single device.")
    command = _command("one_device", mixed_precision=mp)
    test_command = _command("mirrored", virtual_devices=_TEST_REPLICAS,
                            cross_device_ops=ops.value, mixed_precision=mp)
  elif too_big:
    strategy = Recommendation(
        "pipeline", f"the model needs {model_memory_gb:g} GiB and a GPU has "
        f"{smallest / 1024:.1f} GiB: split its layers over the {n} GPUs; "
        "pipeline keeps them busy with micro-batches (model_parallel is the "
        "simpler, sequential alternative).")
    command = _command("pipeline", num_gpus=n, mixed_precision=mp)
  else:
    strategy = Recommendation(
        "mirrored", f"{n} GPUs on one host: synchronous data parallelism, "
        "one replica per GPU.")
    command = _command("mirrored", num_gpus=n, cross_device_ops=ops.value,
                       mixed_precision=mp)
    notes.append(f"Use a --global_batch_size that is a multiple of {n}.")
    notes.append("If the model does not fit on one GPU, use --strategy="
                 "pipeline or model_parallel (--model_memory_gb checks it).")
  if too_big and n == 1:
    problems.append(
        f"the model needs {model_memory_gb:g} GiB but the only GPU has "
        f"{smallest / 1024:.1f} GiB: lower the batch size, use mixed "
        "precision, or use a host with 2+ GPUs for model_parallel/pipeline.")
  if too_big and model_memory_gb * 1024 > smallest * max(n, 1):
    problems.append(f"the model needs {model_memory_gb:g} GiB, more than all "
                    f"{n} GPU(s) together.")
  if n == 0 and (report.cpu.amx_bf16 or report.cpu.avx512_bf16):
    units = "AMX-BF16" if report.cpu.amx_bf16 else "AVX512-BF16"
    notes.append(
        f"This CPU has {units} units: --mixed_precision=mixed_bfloat16 may "
        "speed up large matmuls on CPUs with AMX (through oneDNN), but it "
        "changes numerics and gains depend on the model, so tfmgpu does not "
        "recommend it by default. Measure before adopting it.")
  if len({g.name for g in report.gpus}) > 1:
    notes.append("The GPUs differ: synchronous replicas run at the pace of "
                 "the slowest one.")
  return Recommendations(strategy=strategy, cross_device_ops=ops,
                         mixed_precision=precision, command=command,
                         test_command=test_command, notes=tuple(notes),
                         problems=tuple(problems))


def _command(strategy: str, *, num_gpus: int | None = None,
             virtual_devices: int | None = None,
             cross_device_ops: str | None = None,
             mixed_precision: str | None = None) -> str:
  parts = [_TRAIN, f"--strategy={strategy}"]
  for flag, value in (("num_gpus", num_gpus),
                      ("virtual_devices", virtual_devices),
                      ("cross_device_ops", cross_device_ops),
                      ("mixed_precision", mixed_precision)):
    if value is not None:
      parts.append(f"--{flag}={value}")
  return " ".join(parts)


def _cluster(report: MachineReport) -> Recommendation | None:
  """The multi-host strategy if this process is one task of a cluster."""
  cfg = report.tf_config
  if cfg is not None and cfg.valid:
    if cfg.jobs.get("ps") and cfg.jobs.get("worker"):
      return Recommendation(
          "parameter_server", f"TF_CONFIG describes a cluster with "
          f"{cfg.jobs['ps']} parameter server(s) and {cfg.jobs['worker']} "
          "worker(s): asynchronous training driven by a coordinator.")
    tasks = cfg.jobs.get("chief", 0) + cfg.jobs.get("worker", 0)
    if tasks > 1:
      return Recommendation(
          "multi_worker_mirrored", f"TF_CONFIG describes {tasks} tasks: "
          "synchronous data parallelism across hosts (cluster_resolver="
          "'tf_config').")
  tasks = report.slurm_tasks
  if tasks and tasks > 1:
    return Recommendation(
        "multi_worker_mirrored", f"a SLURM job with {tasks} tasks: synchronous "
        "data parallelism across them (cluster_resolver='slurm').")
  return None


def _cross_device_ops(report: MachineReport) -> Recommendation:
  n = report.num_gpus
  if n >= 2 and report.nccl_usable:
    return Recommendation("nccl", f"all {n} replicas are GPUs and NCCL is "
                          "usable: the fastest all-reduce between GPUs.")
  if n >= 2:
    return Recommendation("hierarchical_copy", f"{n} GPUs but NCCL is not "
                          f"usable ({report.nccl_status()[1]}).")
  if n == 1:
    return Recommendation(
        "hierarchical_copy", "one GPU has nothing to all-reduce; for logical "
        "GPUs split from it (--virtual_devices) use hierarchical_copy, as "
        "NCCL expects one rank per physical GPU.")
  return Recommendation(
      "reduction_to_one", "no GPU: NCCL has no CPU kernel; reduction_to_one "
      "works on logical CPUs and lets runs with different replica counts "
      "share a process.")


def _mixed_precision(report: MachineReport) -> Recommendation:
  if not report.gpus:
    return Recommendation("float32", "no GPU: mixed precision does not pay "
                          "off by default on a CPU.")
  ccs = [g.compute_capability for g in report.gpus]
  if None in ccs:
    return Recommendation("float32", "compute capability unknown for some "
                          "GPU: cannot tell whether it has Tensor Cores.")
  cc = min(ccs)
  shown = f"{cc[0]}.{cc[1]}"
  if cc >= (8, 0):
    return Recommendation(
        "mixed_bfloat16", f"compute capability {shown} (8.0+) has bfloat16 "
        "Tensor Cores: float16 speed with float32 range, no loss scaling.")
  if cc >= (7, 0):
    return Recommendation(
        "mixed_float16", f"compute capability {shown} has float16 Tensor "
        "Cores but no fast bfloat16; needs loss scaling (applied for you).")
  return Recommendation("float32", f"compute capability {shown} < 7.0 has no "
                        "Tensor Cores: mixed precision would not be faster.")


def _problems(report: MachineReport) -> list[str]:
  out = []
  n = report.num_gpus
  visible = report.environment.get("CUDA_VISIBLE_DEVICES")
  if n == 0 and not report.built_with_cuda:
    out.append(f"no GPU found: TensorFlow {report.tensorflow_version} was "
               "built without CUDA. On Linux with an NVIDIA GPU install "
               "'tensorflow[and-cuda]'.")
  elif n == 0:
    msg = (f"no GPU found: TensorFlow is built with CUDA "
           f"{report.cuda_version or '?'} but no GPU is visible; check "
           "CUDA_VISIBLE_DEVICES / drivers")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
      msg += f" (CUDA_VISIBLE_DEVICES={visible!r} hides every GPU)"
    elif report.driver_gpus:
      msg += (f" (nvidia-smi lists {report.driver_gpus} GPU(s) with driver "
              f"{report.driver_version}: check that the driver supports this "
              "CUDA and read TensorFlow's log for libraries it failed to load)")
    elif report.driver_gpus is None:
      msg += " (no NVIDIA driver found: nvidia-smi is not on PATH)"
    out.append(msg + ".")
  elif report.driver_gpus and report.driver_gpus > n and visible is None:
    out.append(f"nvidia-smi lists {report.driver_gpus} GPUs but TensorFlow "
               f"uses {n}: it skips GPUs this build does not target "
               f"({', '.join(report.cuda_compute_capabilities) or '?'}); see "
               "its log.")
  if report.tf_config is not None and not report.tf_config.valid:
    out.append(f"TF_CONFIG is set but invalid: {report.tf_config.error} Fix "
               "or unset it; multi-worker strategies fail until then.")
  if report.keras_version is None:
    out.append("Keras is not installed: pip install 'keras>=3'.")
  elif report.keras_backend != "tensorflow":
    out.append(f"Keras uses the {report.keras_backend!r} backend; tfmgpu "
               "needs 'tensorflow': set KERAS_BACKEND=tensorflow.")
  return out


# ----------------------------------------------------------------- output

def format_report(report: MachineReport, recs: Recommendations) -> str:
  """Returns a human-readable report in sections."""
  def mib(mb: int | None) -> str:
    return "unknown" if mb is None else f"{mb / 1024:.1f} GiB"

  cpu = report.cpu
  cuda = (f"built with CUDA {report.cuda_version}, cuDNN "
          f"{report.cudnn_version}" if report.built_with_cuda
          else "built without CUDA")
  lines = ["tfmgpu doctor", "", "Software",
           f"  Python      {report.python_version} ({report.platform})",
           f"  TensorFlow  {report.tensorflow_version} ({cuda})",
           f"  Keras       {report.keras_version or 'missing'} (backend: "
           f"{report.keras_backend})", "", "GPUs"]
  for g in report.gpus:
    cc = ("?" if g.compute_capability is None
          else "{}.{}".format(*g.compute_capability))
    lines.append(f"  [{g.index}] {g.name}, compute capability {cc}, "
                 f"memory {mib(g.memory_mb)}")
  if not report.gpus:
    lines.append("  none visible to TensorFlow")
  if report.driver_version:
    lines.append(f"  driver      {report.driver_version} "
                 f"({report.driver_gpus} GPU(s) in nvidia-smi)")
  status, why = report.nccl_status()
  lines.append(f"  NCCL        {status}" + (f": {why}" if why else ""))
  bf16 = [u for u, has in (("avx512_bf16", cpu.avx512_bf16),
                           ("amx_bf16", cpu.amx_bf16)) if has]
  lines += ["", "CPU",
            f"  model       {cpu.model or 'unknown'}",
            f"  cores       {cpu.cores} ({cpu.usable_cores} usable by this "
            "process)",
            f"  memory      {mib(cpu.memory_mb)}",
            f"  bf16 units  {', '.join(bf16) or 'none'}", "", "Devices",
            f"  logical     {', '.join(report.logical_devices) or 'none'}"
            + ("" if report.runtime_initialized
               else " (runtime not started: as configured)"),
            "", "Environment"]
  cfg = report.tf_config
  if cfg is None:
    lines.append("  TF_CONFIG   unset")
  elif cfg.valid:
    jobs = ", ".join(f"{j}: {k}" for j, k in cfg.jobs.items())
    lines.append(f"  TF_CONFIG   {jobs}; this task: {cfg.task_type} "
                 f"{cfg.task_index}")
  else:
    lines.append(f"  TF_CONFIG   invalid: {cfg.error}")
  lines += [f"  {k}={v}" for k, v in sorted(report.environment.items())]
  if recs.problems:
    lines += ["", "Problems"] + [f"  - {p}" for p in recs.problems]
  lines += ["", "Recommendations"]
  for label, rec in (("strategy", recs.strategy),
                     ("cross_device_ops", recs.cross_device_ops),
                     ("mixed_precision", recs.mixed_precision)):
    lines.append(f"  {label:<17} {rec.value}: {rec.reason}")
  lines += [f"  - {note}" for note in recs.notes]
  lines += ["", "Start with", f"  {recs.command}"]
  if recs.test_command:
    lines += ["", "Test multi-device code on logical devices",
              f"  {recs.test_command}"]
  return "\n".join(lines)


def to_json(report: MachineReport, recs: Recommendations) -> str:
  """Returns `{"schema_version", "machine", "recommendations"}` as JSON."""
  machine = dataclasses.asdict(report)
  machine["num_gpus"] = report.num_gpus
  machine["nccl_usable"] = report.nccl_usable
  return json.dumps({"schema_version": 1, "machine": machine,
                     "recommendations": dataclasses.asdict(recs)}, indent=2)
