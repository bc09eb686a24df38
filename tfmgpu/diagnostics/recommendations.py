"""How tfmgpu should train on a machine, from its `MachineReport` only.

`recommend()` chooses a strategy, cross-device ops, a mixed precision policy
and the command line to start with, each with its reason, and lists what is
missing or misconfigured.
"""

from __future__ import annotations

import dataclasses

from tfmgpu.diagnostics.report import MachineReport

_TRAIN = "python -m tfmgpu.train"
_TEST_REPLICAS = 2  # Logical devices for the multi-device test command.


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


def recommend(report: MachineReport, *,
              model_memory_gb: float | None = None) -> Recommendations:
  """Chooses strategy, cross-device ops, precision and a command line.

  Args:
    report: a `MachineReport`, from `collect()` or built by hand.
    model_memory_gb: memory one replica of the model needs to train (weights,
      gradients, optimizer state and activations), if known. When it exceeds
      one GPU, a placement (`pipeline` / `model_parallel`) is recommended;
      without GPUs it is compared with the host's RAM. Defaults to `None`
      (assume the model fits).

  Returns:
    `Recommendations`; never raises for a machine without GPUs.

  Raises:
    ValueError: `model_memory_gb` is not positive.
  """
  if model_memory_gb is not None and model_memory_gb <= 0:
    raise ValueError(f"model_memory_gb={model_memory_gb} must be > 0 (GiB).")
  ops = _cross_device_ops(report)
  precision = _mixed_precision(report)
  smallest = min((g.memory_mb for g in report.gpus if g.memory_mb),
                 default=None)
  too_big = bool(model_memory_gb and smallest
                 and model_memory_gb * 1024 > smallest)
  strategy, command, test_command, notes = _strategy(
      report, ops, precision, model_memory_gb if too_big else None, smallest)
  problems = _problems(report)
  if too_big:
    problems += _memory_problems(report.num_gpus, model_memory_gb, smallest)
  no_gpu = _no_gpu_message(report)
  if no_gpu and report.driver_gpus:  # GPUs exist that TensorFlow cannot use.
    problems.insert(0, no_gpu)
  elif no_gpu:  # No GPU is needed: say why there is none, as a note.
    notes.insert(0, no_gpu + " No GPU is needed: tfmgpu trains on the CPU.")
  if model_memory_gb and report.num_gpus == 0:
    _host_memory_check(report, model_memory_gb, notes, problems)
  notes += _hardware_notes(report)
  return Recommendations(strategy=strategy, cross_device_ops=ops,
                         mixed_precision=precision, command=command,
                         test_command=test_command, notes=tuple(notes),
                         problems=tuple(problems))


def _strategy(report: MachineReport, ops: Recommendation,
              precision: Recommendation, too_big_gb: float | None,
              smallest_mb: int | None
              ) -> tuple[Recommendation, str, str | None, list[str]]:
  """Returns (strategy, command, test command, notes) for the machine.

  `too_big_gb` is the model's memory if it exceeds the smallest GPU's
  `smallest_mb`, else `None`.
  """
  n = report.num_gpus
  mp = None if precision.value == "float32" else precision.value
  cluster = _cluster(report)
  if cluster is not None:
    return (cluster, _command(cluster.value, mixed_precision=mp), None,
            ["Run the same command in every task of the cluster."])
  if n == 0:
    strategy = Recommendation(
        "default", "no GPU: one device runs everything (one_device is the "
        "same on a CPU). Logical CPUs (--virtual_devices) test multi-device "
        "code; they share the cores, so they prove correctness, not speed.")
    return strategy, _command("default"), _command(
        "mirrored", virtual_devices=_TEST_REPLICAS,
        cross_device_ops=ops.value), []
  if n == 1:
    strategy = Recommendation(
        "one_device", "one GPU: no replicas to synchronise; model_parallel "
        "and pipeline would only add copies on a single device.")
    return strategy, _command("one_device", mixed_precision=mp), _command(
        "mirrored", virtual_devices=_TEST_REPLICAS,
        cross_device_ops=ops.value, mixed_precision=mp), []
  if too_big_gb is not None:
    strategy = Recommendation(
        "pipeline", f"the model needs {too_big_gb:g} GiB and a GPU has "
        f"{smallest_mb / 1024:.1f} GiB: split its layers over the {n} GPUs; "
        "pipeline keeps them busy with micro-batches (model_parallel is the "
        "simpler, sequential alternative).")
    return (strategy, _command("pipeline", num_gpus=n, mixed_precision=mp),
            None, [])
  strategy = Recommendation(
      "mirrored", f"{n} GPUs on one host: synchronous data parallelism, "
      "one replica per GPU.")
  command = _command("mirrored", num_gpus=n, cross_device_ops=ops.value,
                     mixed_precision=mp)
  return strategy, command, None, [
      f"Use a --global_batch_size that is a multiple of {n}.",
      "If the model does not fit on one GPU, use --strategy=pipeline or "
      "model_parallel (--model_memory_gb checks it)."]


def _memory_problems(n: int, model_memory_gb: float,
                     smallest_mb: int) -> list[str]:
  """Problems of a model bigger than the smallest of the `n` GPUs."""
  out = []
  if n == 1:
    out.append(
        f"the model needs {model_memory_gb:g} GiB but the only GPU has "
        f"{smallest_mb / 1024:.1f} GiB: lower the batch size, use mixed "
        "precision, or use a host with 2+ GPUs for model_parallel/pipeline.")
  if model_memory_gb * 1024 > smallest_mb * max(n, 1):
    out.append(f"the model needs {model_memory_gb:g} GiB, more than all "
               f"{n} GPU(s) together.")
  return out


def _hardware_notes(report: MachineReport) -> list[str]:
  """Notes on bfloat16 CPU units and on GPUs that differ."""
  notes = []
  if report.num_gpus == 0 and (report.cpu.amx_bf16 or report.cpu.avx512_bf16):
    units = "AMX-BF16" if report.cpu.amx_bf16 else "AVX512-BF16"
    notes.append(
        f"This CPU has {units} units: --mixed_precision=mixed_bfloat16 may "
        "speed up large matmuls on CPUs with AMX (through oneDNN), but it "
        "changes numerics and gains depend on the model, so tfmgpu does not "
        "recommend it by default. Measure before adopting it.")
  if len({g.name for g in report.gpus}) > 1:
    notes.append("The GPUs differ: synchronous replicas run at the pace of "
                 "the slowest one.")
  return notes + _onednn_notes(report)


def _onednn_notes(report: MachineReport) -> list[str]:
  """A CPU-only host where TensorFlow left its oneDNN kernels off by its
  own default (not by the user's `TF_ENABLE_ONEDNN_OPTS=0`)."""
  if (report.num_gpus or report.cpu.onednn is not False
      or "TF_ENABLE_ONEDNN_OPTS" in report.environment):
    return []
  return ["TensorFlow left its oneDNN CPU kernels off on this CPU (its "
          "default here). TF_ENABLE_ONEDNN_OPTS=1, set before TensorFlow "
          "starts, turns them on: on a 2-core AVX2 host a convnet then "
          "trained 2.3x faster, but a ResNet split in 3 stages on logical "
          "CPUs crashed TensorFlow (a segmentation fault), and results "
          "differ in float32 rounding (docs/benchmarks.md). tfmgpu leaves "
          "it to you: try your model with it before adopting it."]


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


def _no_gpu_message(report: MachineReport) -> str | None:
  """Why TensorFlow sees no GPU, or `None` when it sees one."""
  if report.num_gpus:
    return None
  if not report.built_with_cuda:
    return (f"no GPU found: TensorFlow {report.tensorflow_version} was built "
            "without CUDA. On Linux with an NVIDIA GPU install "
            "'tensorflow[and-cuda]'.")
  visible = report.environment.get("CUDA_VISIBLE_DEVICES")
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
  return msg + "."


def _host_memory_check(report: MachineReport, model_memory_gb: float,
                       notes: list[str], problems: list[str]) -> None:
  """Without GPUs, `model_memory_gb` is compared with the host's RAM."""
  ram_mb = report.cpu.memory_mb
  if not ram_mb:
    notes.append(f"--model_memory_gb={model_memory_gb:g} is not used: there "
                 "is no GPU to compare it with and this host's RAM is unknown.")
  elif model_memory_gb * 1024 > ram_mb:
    problems.append(
        f"the model needs {model_memory_gb:g} GiB but this host has "
        f"{ram_mb / 1024:.1f} GiB of RAM and no GPU: use a smaller model or "
        "batch, or a machine with more memory or GPUs.")
  else:
    notes.append(f"--model_memory_gb={model_memory_gb:g}: checked against "
                 f"this host's {ram_mb / 1024:.1f} GiB of RAM (no GPU): it "
                 "fits.")


def _problems(report: MachineReport) -> list[str]:
  """Misconfigurations; a missing GPU is `_no_gpu_message`'s."""
  out = []
  n = report.num_gpus
  visible = report.environment.get("CUDA_VISIBLE_DEVICES")
  if n and report.driver_gpus and report.driver_gpus > n and visible is None:
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
