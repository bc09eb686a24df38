"""Tests for tfmgpu.diagnostics and the `python -m tfmgpu.doctor` CLI."""

import dataclasses
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

from absl import app
from absl import flags
from absl.testing import flagsaver
import keras
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import diagnostics
from tfmgpu.diagnostics import probe
from tfmgpu import doctor
from tfmgpu import strategies

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TRAIN = "python -m tfmgpu.train"


def _fake(num_gpus: int = 0, cc=(8, 0), memory_mb: int = 81920,
          **changes) -> diagnostics.MachineReport:
  """A Linux host with a CUDA build of TF and `num_gpus` identical GPUs."""
  gpus = tuple(diagnostics.GpuInfo(index=i, name="NVIDIA Fake",
                                   compute_capability=cc, memory_mb=memory_mb)
               for i in range(num_gpus))
  base = diagnostics.MachineReport(
      python_version="3.11.7", platform="linux", tensorflow_version="2.21.0",
      keras_version="3.15.1", keras_backend="tensorflow",
      built_with_cuda=True, cuda_version="12.5.1", cudnn_version="9",
      gpus=gpus, driver_version="550.54" if num_gpus else None,
      driver_gpus=num_gpus if num_gpus else None,
      cpu=diagnostics.CpuInfo(model="Fake CPU", cores=64, usable_cores=64,
                              memory_mb=512 * 1024),
      logical_devices=("/device:CPU:0",) + tuple(
          f"/device:GPU:{i}" for i in range(num_gpus)))
  return dataclasses.replace(base, **changes)


def _tf_config(cluster, task_type="worker", index=0):
  return diagnostics.summarize_tf_config(json.dumps(
      {"cluster": cluster, "task": {"type": task_type, "index": index}}))


# ------------------------------------------------------- this machine

@pytest.fixture(scope="module")
def report():
  return diagnostics.collect()


def test_collect_describes_this_machine(report):
  assert report.python_version == platform.python_version()
  assert report.tensorflow_version == tf.__version__
  assert report.keras_version == keras.__version__
  assert report.keras_backend == "tensorflow"
  assert report.built_with_cuda == tf.test.is_built_with_cuda()
  assert report.num_gpus == len(tf.config.list_physical_devices("GPU"))
  # conftest split the CPU and started the runtime before this test.
  assert report.runtime_initialized
  assert list(report.logical_devices) == tfmgpu.list_devices()
  assert report.cpu.cores == os.cpu_count()
  assert 1 <= report.cpu.usable_cores <= report.cpu.cores
  assert report.cpu.memory_mb > 0


def test_recommend_on_this_cpu_only_machine(report):
  if report.gpus:
    pytest.skip("describes a machine without GPUs")
  recs = diagnostics.recommend(report)
  assert not report.nccl_usable
  assert recs.strategy.value == "default"
  assert recs.cross_device_ops.value == "reduction_to_one"
  assert recs.mixed_precision.value == "float32"
  assert recs.command == f"{_TRAIN} --strategy=default"
  assert recs.test_command == (f"{_TRAIN} --strategy=mirrored "
                               "--virtual_devices=2 "
                               "--cross_device_ops=reduction_to_one")
  for command in (recs.command, recs.test_command):
    assert "--num_gpus" not in command
    assert "nccl" not in command
    assert "--mixed_precision" not in command
  build = "is built with CUDA" if report.built_with_cuda else "without CUDA"
  where = recs.problems if report.driver_gpus else recs.notes
  assert where[0].startswith("no GPU found")
  assert build in where[0]
  amx_note = any("does not recommend it by default" in n for n in recs.notes)
  assert amx_note == (report.cpu.amx_bf16 or report.cpu.avx512_bf16)


# ------------------------------------------------------- fake machines

_CASES = {
    "1gpu_cc7.0": (1, (7, 0), "one_device", "hierarchical_copy",
                   "mixed_float16",
                   f"{_TRAIN} --strategy=one_device "
                   "--mixed_precision=mixed_float16",
                   f"{_TRAIN} --strategy=mirrored --virtual_devices=2 "
                   "--cross_device_ops=hierarchical_copy "
                   "--mixed_precision=mixed_float16"),
    "1gpu_cc8.0": (1, (8, 0), "one_device", "hierarchical_copy",
                   "mixed_bfloat16",
                   f"{_TRAIN} --strategy=one_device "
                   "--mixed_precision=mixed_bfloat16",
                   f"{_TRAIN} --strategy=mirrored --virtual_devices=2 "
                   "--cross_device_ops=hierarchical_copy "
                   "--mixed_precision=mixed_bfloat16"),
    "8gpu_cc7.0": (8, (7, 0), "mirrored", "nccl", "mixed_float16",
                   f"{_TRAIN} --strategy=mirrored --num_gpus=8 "
                   "--cross_device_ops=nccl --mixed_precision=mixed_float16",
                   None),
    "8gpu_cc8.0": (8, (8, 0), "mirrored", "nccl", "mixed_bfloat16",
                   "python -m tfmgpu.train --strategy=mirrored --num_gpus=8 "
                   "--cross_device_ops=nccl --mixed_precision=mixed_bfloat16",
                   None),
    "8gpu_cc9.0": (8, (9, 0), "mirrored", "nccl", "mixed_bfloat16",
                   f"{_TRAIN} --strategy=mirrored --num_gpus=8 "
                   "--cross_device_ops=nccl --mixed_precision=mixed_bfloat16",
                   None),
    "2gpu_cc6.1": (2, (6, 1), "mirrored", "nccl", "float32",
                   f"{_TRAIN} --strategy=mirrored --num_gpus=2 "
                   "--cross_device_ops=nccl", None),
}


@pytest.mark.parametrize(
    "num_gpus,cc,strategy,ops,precision,command,test_command",
    list(_CASES.values()), ids=list(_CASES))
def test_recommend_for_gpus(num_gpus, cc, strategy, ops, precision, command,
                            test_command):
  report = _fake(num_gpus, cc)
  recs = diagnostics.recommend(report)
  assert report.nccl_usable == (num_gpus >= 2)
  assert recs.strategy.value == strategy
  assert recs.cross_device_ops.value == ops
  assert recs.mixed_precision.value == precision
  assert f"{cc[0]}.{cc[1]}" in recs.mixed_precision.reason
  assert recs.command == command
  assert recs.test_command == test_command
  assert recs.problems == ()


@pytest.mark.parametrize("report", [
    _fake(0), _fake(1), _fake(8), _fake(8, platform="win32"),
    _fake(2, tf_config=_tf_config({"worker": ["a:1", "b:1"]})),
    _fake(2, tf_config=_tf_config({"ps": ["p:1"], "worker": ["a:1"]})),
], ids=["cpu", "1gpu", "8gpu", "8gpu_windows", "multi_worker", "ps"])
def test_recommended_names_are_ones_the_cli_accepts(report):
  recs = diagnostics.recommend(report)
  assert recs.strategy.value in tfmgpu.available_strategies()
  assert recs.cross_device_ops.value in strategies.CROSS_DEVICE_OPS_CHOICES
  assert keras.DTypePolicy(recs.mixed_precision.value).name == (
      recs.mixed_precision.value)


def test_gpus_without_nccl_use_hierarchical_copy():
  report = _fake(8, platform="win32")
  recs = diagnostics.recommend(report)
  assert not report.nccl_usable
  assert report.nccl_status() == (
      "not usable", "NCCL ships for Linux only (platform is win32)")
  assert recs.cross_device_ops.value == "hierarchical_copy"
  assert recs.command == (f"{_TRAIN} --strategy=mirrored --num_gpus=8 "
                          "--cross_device_ops=hierarchical_copy "
                          "--mixed_precision=mixed_bfloat16")


def test_mixed_gpus_follow_the_weakest():
  gpus = (diagnostics.GpuInfo(0, "NVIDIA A100", (8, 0), 40960),
          diagnostics.GpuInfo(1, "Tesla T4", (7, 5), 15360))
  recs = diagnostics.recommend(_fake(0, gpus=gpus))
  assert recs.mixed_precision.value == "mixed_float16"
  assert any("slowest" in n for n in recs.notes)
  unknown = (diagnostics.GpuInfo(0, "unknown"),) * 2
  recs = diagnostics.recommend(_fake(0, gpus=unknown))
  assert recs.mixed_precision.value == "float32"
  assert "unknown" in recs.mixed_precision.reason


@pytest.mark.parametrize("changes,strategy,command", [
    ({"tf_config": _tf_config({"chief": ["c:1"], "worker": ["a:1", "b:1"]},
                              "chief")},
     "multi_worker_mirrored",
     f"{_TRAIN} --strategy=multi_worker_mirrored "
     "--mixed_precision=mixed_bfloat16"),
    ({"environment": {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}},
     "multi_worker_mirrored",
     f"{_TRAIN} --strategy=multi_worker_mirrored "
     "--mixed_precision=mixed_bfloat16"),
    ({"tf_config": _tf_config({"ps": ["p:1"], "worker": ["a:1", "b:1"]},
                              "worker", 1)},
     "parameter_server",
     f"{_TRAIN} --strategy=parameter_server --mixed_precision=mixed_bfloat16"),
], ids=["tf_config", "slurm", "parameter_server"])
def test_cluster_environment_selects_multi_host_strategy(changes, strategy,
                                                         command):
  recs = diagnostics.recommend(_fake(2, **changes))
  assert recs.strategy.value == strategy
  assert recs.command == command
  assert recs.problems == ()


def test_one_task_cluster_is_a_single_host():
  recs = diagnostics.recommend(
      _fake(8, tf_config=_tf_config({"worker": ["a:1"]}),
            environment={"SLURM_NTASKS": "1"}))
  assert recs.strategy.value == "mirrored"


def test_invalid_tf_config_is_a_problem_not_a_cluster():
  summary = _tf_config({"worker": ["a:1"]}, index=3)
  assert not summary.valid
  assert "out of range" in summary.error
  recs = diagnostics.recommend(_fake(8, tf_config=summary))
  assert recs.strategy.value == "mirrored"
  assert any(p.startswith("TF_CONFIG is set but invalid: TF_CONFIG task index")
             for p in recs.problems)


def test_tf_config_summary():
  summary = _tf_config({"chief": ["c:1"], "worker": ["a:1", "b:1"]},
                       "worker", 1)
  assert summary == diagnostics.TfConfigSummary(
      jobs={"chief": 1, "worker": 2}, task_type="worker", task_index=1)
  assert "not valid JSON" in diagnostics.summarize_tf_config("{").error


@pytest.mark.parametrize("changes,expected", [
    ({"built_with_cuda": False, "cuda_version": None},
     "no GPU found: TensorFlow 2.21.0 was built without CUDA."),
    ({"environment": {"CUDA_VISIBLE_DEVICES": ""}},
     "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ({"environment": {"CUDA_VISIBLE_DEVICES": "-1"}},
     "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
    ({"driver_gpus": 2, "driver_version": "550.54"},
     "nvidia-smi lists 2 GPU(s) with driver 550.54"),
    ({}, "no NVIDIA driver found: nvidia-smi is not on PATH"),
], ids=["cpu_build", "cvd_empty", "cvd_minus_one", "driver_sees_gpus",
        "no_driver"])
def test_says_what_is_missing_without_gpus(changes, expected):
  recs = diagnostics.recommend(_fake(0, **changes))
  assert recs.strategy.value == "default"
  # A problem only when GPUs exist that TensorFlow does not use; else a note.
  where = recs.problems if changes.get("driver_gpus") else recs.notes
  assert where[0].startswith("no GPU found")
  assert expected in where[0]
  if where is recs.notes:
    assert where[0].endswith("No GPU is needed: tfmgpu trains on the CPU.")
    assert not any("no GPU" in p for p in recs.problems)


def test_model_memory_without_gpus_is_checked_against_host_ram():
  host = _fake(0, cpu=diagnostics.CpuInfo(memory_mb=16 * 1024))
  recs = diagnostics.recommend(host, model_memory_gb=4)
  assert ("--model_memory_gb=4: checked against this host's 16.0 GiB of RAM "
          "(no GPU): it fits.") in recs.notes
  assert recs.problems == ()
  recs = diagnostics.recommend(host, model_memory_gb=40)
  assert recs.problems == (
      "the model needs 40 GiB but this host has 16.0 GiB of RAM and no GPU: "
      "use a smaller model or batch, or a machine with more memory or GPUs.",)
  unknown = _fake(0, cpu=diagnostics.CpuInfo(memory_mb=None))
  assert ("--model_memory_gb=4 is not used: there is no GPU to compare it "
          "with and this host's RAM is unknown.") in diagnostics.recommend(
              unknown, model_memory_gb=4).notes


def test_keras_backend_problem():
  recs = diagnostics.recommend(_fake(1, keras_backend="jax"))
  assert recs.problems == (
      "Keras uses the 'jax' backend; tfmgpu needs 'tensorflow': set "
      "KERAS_BACKEND=tensorflow.",)


def test_model_too_big_for_one_gpu():
  recs = diagnostics.recommend(_fake(8, memory_mb=40960), model_memory_gb=100)
  assert recs.strategy.value == "pipeline"
  assert recs.command == (f"{_TRAIN} --strategy=pipeline --num_gpus=8 "
                          "--mixed_precision=mixed_bfloat16")
  assert "model_parallel" in recs.strategy.reason
  assert recs.problems == ()
  assert diagnostics.recommend(
      _fake(8), model_memory_gb=10).strategy.value == "mirrored"
  recs = diagnostics.recommend(_fake(1, memory_mb=16384), model_memory_gb=20)
  assert recs.strategy.value == "one_device"
  assert "the only GPU has 16.0 GiB" in recs.problems[0]
  with pytest.raises(ValueError, match=r"model_memory_gb=0 must be > 0"):
    diagnostics.recommend(_fake(1), model_memory_gb=0)


@pytest.mark.parametrize("visible,expected", [
    (None, 40960), ("1,0", 81920), ("GPU-bbbb", 81920), ("GPU-cccc", None),
], ids=["in_order", "reordered", "uuid", "unknown_uuid"])
def test_nvidia_smi_memory_follows_cuda_visible_devices(visible, expected):
  smi = [{"index": 0, "uuid": "GPU-aaaa-1", "name": "A", "memory_mb": 40960},
         {"index": 1, "uuid": "GPU-bbbb-2", "name": "A", "memory_mb": 81920}]
  tokens = visible.split(",") if visible else None
  smi_memory = probe._smi_memory  # pylint: disable=protected-access
  assert smi_memory(0, "A", smi, tokens) == expected
  # A name that does not match nvidia-smi's means a wrong mapping: unknown.
  assert smi_memory(0, "B", smi, tokens) is None


def test_format_report_and_json():
  report = _fake(8, environment={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
  recs = diagnostics.recommend(report)
  text = diagnostics.format_report(report, recs)
  for section in ("Software", "GPUs", "CPU", "Devices", "Environment",
                  "Recommendations", "Start with"):
    assert f"\n{section}\n" in text
  assert "[7] NVIDIA Fake, compute capability 8.0, memory 80.0 GiB" in text
  assert "  NCCL        usable\n" in text
  assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in text
  assert text.rstrip().endswith(recs.command)
  assert "Problems" not in text
  data = json.loads(diagnostics.to_json(report, recs))
  assert data["schema_version"] == 1
  assert data["machine"]["num_gpus"] == 8
  assert data["machine"]["nccl_usable"] is True
  assert data["machine"]["gpus"][0]["compute_capability"] == [8, 0]
  assert data["recommendations"]["command"] == recs.command
  assert data["recommendations"]["mixed_precision"]["value"] == "mixed_bfloat16"


# --------------------------------------------------------------- CLI

def _run_main(capsys, *args: str) -> str:
  with flagsaver.flagsaver():
    doctor.main(flags.FLAGS(["doctor", *args]))
  return capsys.readouterr().out


def test_cli_text(capsys):
  out = _run_main(capsys)
  assert out.startswith("tfmgpu doctor\n")
  if shutil.which("nvidia-smi") is None:  # No GPU is needed: no problem.
    problems = out.partition("\nRecommendations\n")[0].partition(
        "\nProblems\n")[2]
    assert "no GPU found" not in problems
    assert "no GPU found" in out
  assert "\nRecommendations\n" in out
  assert f"\nStart with\n  {_TRAIN} --strategy=" in out


def test_cli_json(capsys):
  data = json.loads(_run_main(capsys, "--json", "--model_memory_gb=1"))
  assert set(data) == {"schema_version", "machine", "recommendations"}
  assert {"tensorflow_version", "gpus", "cpu", "logical_devices",
          "nccl_usable", "tf_config", "environment"} <= set(data["machine"])
  assert set(data["recommendations"]) == {
      "strategy", "cross_device_ops", "mixed_precision", "command",
      "test_command", "notes", "problems"}
  assert data["machine"]["logical_devices"] == tfmgpu.list_devices()


def test_cli_rejects_bad_input():
  with flagsaver.flagsaver():
    with pytest.raises(flags.IllegalFlagValueError):
      flags.FLAGS(["doctor", "--model_memory_gb=0"])
  with pytest.raises(app.UsageError, match="Unexpected arguments: extra"):
    doctor.main(["doctor", "extra"])


@pytest.mark.slow
def test_cli_subprocess_json():
  proc = subprocess.run([sys.executable, "-m", "tfmgpu.doctor", "--json"],
                        capture_output=True, text=True, cwd=_ROOT, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads(proc.stdout)
  # collect() never starts the runtime: a notebook can configure devices after.
  assert data["machine"]["runtime_initialized"] is False
  assert data["machine"]["logical_devices"]
  assert data["recommendations"]["command"].startswith(_TRAIN)


@pytest.mark.slow
def test_cli_help_does_not_import_tensorflow():
  proc = subprocess.run(
      [sys.executable, "-X", "importtime", "-m", "tfmgpu.doctor", "--help"],
      capture_output=True, text=True, cwd=_ROOT, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]  # Asked for help: done.
  assert "--[no]json" in proc.stdout
  assert "--model_memory_gb" in proc.stdout
  imported = [line.rsplit("|", 1)[-1].strip()
              for line in proc.stderr.splitlines() if "|" in line]
  assert "tfmgpu.doctor" in imported or "tfmgpu" in imported
  assert "tensorflow" not in imported
  assert "keras" not in imported


def test_onednn_left_off_by_tensorflow_is_said_on_a_cpu_host():
  """TensorFlow leaves its oneDNN CPU kernels off on some CPUs (a 2-core
  AVX2 EPYC: a convnet trained 2.3x slower so): the doctor says so and
  how to turn them on, unless the user set TF_ENABLE_ONEDNN_OPTS or a GPU
  trains."""
  def notes(**changes):
    return [n for n in diagnostics.recommend(_fake(0, **changes)).notes
            if "oneDNN" in n]
  off = diagnostics.CpuInfo(model="Fake CPU", cores=2, onednn=False)
  assert len(notes(cpu=off)) == 1
  assert "TF_ENABLE_ONEDNN_OPTS=1, set before TensorFlow starts" in (
      notes(cpu=off)[0])
  assert not notes(cpu=off, environment={"TF_ENABLE_ONEDNN_OPTS": "0"})
  assert not notes(cpu=dataclasses.replace(off, onednn=True))
  assert not notes(cpu=dataclasses.replace(off, onednn=None))
  text = diagnostics.format_report(_fake(0, cpu=off),
                                   diagnostics.recommend(_fake(0, cpu=off)))
  assert "  oneDNN      off (TensorFlow's oneDNN CPU kernels)" in text
  with_gpu = diagnostics.recommend(_fake(2, cpu=off)).notes
  assert not [n for n in with_gpu if "oneDNN" in n]


def test_collect_reads_whether_onednn_is_on(report):
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  assert report.cpu.onednn is _compat.onednn_enabled()
  assert report.cpu.onednn in (True, False)
