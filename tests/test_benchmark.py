"""Benchmark primitives: counted FLOPs, bytes, the projection formula, the CLI.

Speed itself is never asserted here (figures live in the suite's output).
"""

import csv
import subprocess
import sys

import pytest

from tfmgpu import models
from tfmgpu.benchmarks import ceiling, projection
from tfmgpu.benchmarks import report as report_lib


def test_training_flops_are_counted_from_the_layers():
  mlp = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10)
  dense = [(784, 256), (256, 256), (256, 10)]
  forward = sum(2 * i * o + o for i, o in dense) + 256 + 256  # + two ReLUs
  assert ceiling.training_flops_per_example(mlp) == 3 * forward


def test_gradient_bytes():
  mlp = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10)
  params = sum(i * o + o for i, o in [(784, 256), (256, 256), (256, 10)])
  assert projection.gradient_bytes(mlp) == 4 * params
  assert projection.gradient_bytes(mlp, "float16") == 2 * params


def test_ring_all_reduce_projection():
  p = projection.project_data_parallel(10.0, 24 * 10**6, 4, "pcie4")
  # 2 (N-1)/N x bytes / bandwidth = 1.5 x 24 MB / 24 GB/s = 1.5 ms.
  assert p.allreduce_ms == pytest.approx(1.5)
  assert p.step_ms == pytest.approx(11.5)
  assert p.scaling_efficiency == pytest.approx(10 / 11.5)
  assert projection.project_data_parallel(10.0, 10**9, 1).allreduce_ms == 0
  with pytest.raises(ValueError, match=r"link='wifi' is unknown"):
    projection.project_data_parallel(1.0, 1, 2, "wifi")


def test_report_csv(tmp_path):
  report = report_lib.Report(out=lambda s: None)
  report.add(report_lib.Row("training", "mlp", 2, "tfmgpu", 1.5, 42000.0))
  path = report.write_csv(str(tmp_path / "r.csv"))
  rows = list(csv.DictReader(open(path)))
  assert rows[0]["path"] == "tfmgpu" and float(rows[0]["ms_per_step"]) == 1.5


@pytest.mark.slow
def test_bench_cli_runs_a_section(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "tfmgpu.bench", "--quick", "--models=mlp",
       "--replicas=1,2", "--sections=training,projection",
       f"--output_dir={tmp_path}"], capture_output=True, text=True,
      timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "tfmgpu/keras_fit mlp x2" in out.stdout
  assert "keras_fit_fused" in out.stdout
  assert "thread(s) per op" in out.stdout
  assert "Projection (not a measurement)" in out.stdout
  assert (tmp_path / "results.csv").exists()
  assert (tmp_path / "throughput.png").exists()
