"""A `MachineReport` and its `Recommendations` as text or JSON."""

from __future__ import annotations

import dataclasses
import json

from tfmgpu.diagnostics.recommendations import Recommendations
from tfmgpu.diagnostics.report import MachineReport


def format_report(report: MachineReport, recs: Recommendations) -> str:
  """Returns a human-readable report in sections."""
  lines = (["tfmgpu doctor", ""] + _software(report) + [""] + _gpus(report) +
           [""] + _cpu_and_devices(report) + [""] + _environment(report) +
           _recommendations(recs))
  return "\n".join(lines)


def _mib(mb: int | None) -> str:
  return "unknown" if mb is None else f"{mb / 1024:.1f} GiB"


def _software(report: MachineReport) -> list[str]:
  cuda = (f"built with CUDA {report.cuda_version}, cuDNN "
          f"{report.cudnn_version}" if report.built_with_cuda
          else "built without CUDA")
  return ["Software",
          f"  Python      {report.python_version} ({report.platform})",
          f"  TensorFlow  {report.tensorflow_version} ({cuda})",
          f"  Keras       {report.keras_version or 'missing'} (backend: "
          f"{report.keras_backend})"]


def _gpus(report: MachineReport) -> list[str]:
  lines = ["GPUs"]
  for g in report.gpus:
    cc = ("?" if g.compute_capability is None
          else "{}.{}".format(*g.compute_capability))
    lines.append(f"  [{g.index}] {g.name}, compute capability {cc}, "
                 f"memory {_mib(g.memory_mb)}")
  if not report.gpus:
    lines.append("  none visible to TensorFlow")
  if report.driver_version:
    lines.append(f"  driver      {report.driver_version} "
                 f"({report.driver_gpus} GPU(s) in nvidia-smi)")
  status, why = report.nccl_status()
  lines.append(f"  NCCL        {status}" + (f": {why}" if why else ""))
  return lines


def _cpu_and_devices(report: MachineReport) -> list[str]:
  cpu = report.cpu
  bf16 = [u for u, has in (("avx512_bf16", cpu.avx512_bf16),
                           ("amx_bf16", cpu.amx_bf16)) if has]
  return ["CPU",
          f"  model       {cpu.model or 'unknown'}",
          f"  cores       {cpu.cores} ({cpu.usable_cores} usable by this "
          "process)",
          f"  memory      {_mib(cpu.memory_mb)}",
          f"  bf16 units  {', '.join(bf16) or 'none'}",
          f"  oneDNN      {_onednn(cpu.onednn)}", "", "Devices",
          f"  logical     {', '.join(report.logical_devices) or 'none'}"
          + ("" if report.runtime_initialized
             else " (runtime not started: as configured)")]


def _onednn(on: bool | None) -> str:
  """TensorFlow's oneDNN CPU kernels: on, off or unknown."""
  return {True: "on", False: "off"}.get(on, "unknown") + (
      " (TensorFlow's oneDNN CPU kernels)")


def _environment(report: MachineReport) -> list[str]:
  lines = ["Environment"]
  cfg = report.tf_config
  if cfg is None:
    lines.append("  TF_CONFIG   unset")
  elif cfg.valid:
    jobs = ", ".join(f"{j}: {k}" for j, k in cfg.jobs.items())
    lines.append(f"  TF_CONFIG   {jobs}; this task: {cfg.task_type} "
                 f"{cfg.task_index}")
  else:
    lines.append(f"  TF_CONFIG   invalid: {cfg.error}")
  return lines + [f"  {k}={v}" for k, v in sorted(report.environment.items())]


def _recommendations(recs: Recommendations) -> list[str]:
  lines = []
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
  return lines


def to_json(report: MachineReport, recs: Recommendations) -> str:
  """Returns `{"schema_version", "machine", "recommendations"}` as JSON."""
  machine = dataclasses.asdict(report)
  machine["num_gpus"] = report.num_gpus
  machine["nccl_usable"] = report.nccl_usable
  return json.dumps({"schema_version": 1, "machine": machine,
                     "recommendations": dataclasses.asdict(recs)}, indent=2)
