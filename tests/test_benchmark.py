"""Benchmark primitives: counted FLOPs, bytes, the projection formula, the
report (spreads, the CPU, the CSV), `--compare`, the CLI.

Speed itself is never asserted here (figures live in the suite's output).
"""

import csv
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from tfmgpu import models
from tfmgpu.benchmarks import ceiling, compare, projection
from tfmgpu.benchmarks import report as report_lib
from tfmgpu.training import autotune


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


def test_ratios_carry_their_spread_and_headers_name_the_cpu():
  lines = []
  report = report_lib.Report(out=lines.append, cpu="Test CPU 9000")
  report.header("Training throughput")
  assert lines[-1] == "\n== Training throughput [Test CPU 9000] =="
  # Per-round ratios 2.4/2.0 = 1.2 and 2.6/2.0 = 1.3; best rounds 2.4/2.0.
  spread = report_lib.round_ratios([2.4, 2.6], [2.0, 2.0])
  assert spread == pytest.approx((1.2, 1.3))
  report.figure("tfmgpu/keras_fit mlp x2", 1.2, "(target >= 1.2)", spread)
  assert "1.200 (1.20-1.30)" in lines[-1]
  assert report_lib.round_ratios([2.0], [1.0]) is None  # One round: none.
  assert report_lib.with_spread(1.234, None) == "1.23"
  assert report_lib.Report(out=lines.append).cpu == autotune.cpu_model()



def test_compare_builds_each_path_once_then_interleaves_its_rounds(
    monkeypatch):
  """Tracing stays out of the rounds, and the paths take turns."""
  from tfmgpu.benchmarks import training  # pylint: disable=g-import-not-at-top
  log = []

  def fake(path, times_ms):
    def prepare(strategy, model_name, arrays, **kwargs):
      log.append(("build", path))
      times = iter(times_ms)

      def one_round():
        log.append(("round", path))
        return training.Timing(path, next(times), kwargs["global_batch_size"])
      return one_round
    return prepare

  monkeypatch.setattr(training, "PATHS", {
      "tfmgpu": fake("tfmgpu", [3.0, 2.0, 4.0]),
      "keras_fit": fake("keras_fit", [5.0, 6.0, 4.5])})
  best = training.compare(None, "mlp", None, global_batch_size=64, steps=10,
                          rounds=3, paths=["tfmgpu", "keras_fit"])
  assert log == [("build", "tfmgpu"), ("build", "keras_fit")] + [
      ("round", "tfmgpu"), ("round", "keras_fit")] * 3
  assert best["tfmgpu"].ms_per_step == 2.0
  assert best["tfmgpu"].rounds_ms == (3.0, 2.0, 4.0)
  assert best["keras_fit"].ms_per_step == 4.5

@pytest.mark.parametrize("same_kernels", [False, True])
def test_the_floor_computes_the_loss_as_the_trainer_does(
    monkeypatch, same_kernels, float64_keras):  # pylint: disable=unused-argument
  """The floor called `objectives.default_loss` on the logits as they come
  (float32), while the Trainer computes its loss in Keras' floatx: under
  float64 the bench timed another loss than the one it compared."""
  from tfmgpu import data  # pylint: disable=g-import-not-at-top
  from tfmgpu.benchmarks import training  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import objectives  # pylint: disable=g-import-not-at-top
  dtypes = []
  trainers = objectives.Objective.per_example_loss

  def spy(self, *args, **kwargs):
    out = trainers(self, *args, **kwargs)
    dtypes.append(out.dtype.name)
    return out

  monkeypatch.setattr(objectives.Objective, "per_example_loss", spy)
  training.prepare_floor("mlp", data.load_dataset("digits8x8"),
                         global_batch_size=8, steps=2, warmup=0,
                         same_kernels=same_kernels)()
  assert dtypes and set(dtypes) == {"float64"}


def _run_csv(path, cpu, fit_ms, tfmgpu_ms):
  report = report_lib.Report(out=lambda s: None, cpu=cpu,
                             machine=f"{cpu}; 2 cores")
  report.add(report_lib.Row("training", "mlp", 2, "tfmgpu", tfmgpu_ms[0],
                            64e3 / tfmgpu_ms[0], "", tfmgpu_ms))
  report.add(report_lib.Row("training", "mlp", 2, "keras_fit", fit_ms[0],
                            64e3 / fit_ms[0], "", fit_ms))
  report.figure("tfmgpu/keras_fit mlp x2", fit_ms[0] / tfmgpu_ms[0], "",
                report_lib.round_ratios(fit_ms, tfmgpu_ms))
  return report.write_csv(str(path))


def test_the_csv_names_the_cpu_and_compare_prints_two_runs(tmp_path):
  a = _run_csv(tmp_path / "a.csv", "Intel(R) Xeon(R)", [2.0, 2.2], [1.0, 1.0])
  b = _run_csv(tmp_path / "b.csv", "AMD EPYC", [2.0, 2.1], [2.0, 1.5])
  rows = list(csv.DictReader(open(a)))
  assert {r["cpu"] for r in rows} == {"Intel(R) Xeon(R)"}
  assert rows[0]["rounds_ms"] == "1.0000;1.0000"
  assert rows[-1]["section"] == "figure" and float(rows[-1]["value"]) == 2.0
  lines = []
  compare.compare_runs(compare.read_run(a), compare.read_run(b),
                       out=lines.append)
  text = "\n".join(lines)
  assert ("== Headline figures: A [Intel(R) Xeon(R)] | B [AMD EPYC] =="
          in text)
  figure, = [l for l in lines if l.startswith("  tfmgpu/keras_fit mlp x2")]
  assert figure.split()[-4:] == ["2.000", "(2.00-2.20)", "1.000",
                                 "(1.00-1.40)"]
  timing, = [l for l in lines if "keras_fit" in l and "training" in l]
  assert timing.split()[-3:] == ["2.000", "2.000", "1.00"]


def test_compare_reads_a_csv_written_before_figures(tmp_path):
  old = tmp_path / "old.csv"
  old.write_text("section,model,replicas,path,ms_per_step,examples_per_sec,"
                 "note\ntraining,mlp,2,tfmgpu,1.25,51200,\n"
                 "training,mlp,2,keras_fit,2.5,25600,\n")
  run = compare.read_run(str(old))
  assert run.cpu == "unknown CPU"
  assert run.figures == {"tfmgpu/keras_fit mlp x2": (2.0, None, None)}


def test_compare_names_a_missing_or_foreign_file(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match=r"--compare file '.*nope.csv' does not exist"):
    compare.read_run(str(tmp_path / "nope.csv"))
  other = tmp_path / "other.csv"
  other.write_text("a,b\n1,2\n")
  with pytest.raises(ValueError, match=r"is not a bench results.csv: it "
                     r"lacks the columns \['section'"):
    compare.read_run(str(other))


def test_bench_compare_prints_without_loading_tensorflow(tmp_path):
  a = _run_csv(tmp_path / "a.csv", "CPU A", [2.0, 2.2], [1.0, 1.0])
  b = _run_csv(tmp_path / "b.csv", "CPU B", [2.0, 2.1], [2.0, 1.5])
  code = ("import sys\nfrom absl import flags\nfrom tfmgpu import bench\n"
          "rest = flags.FLAGS(sys.argv)\nrc = bench.main(rest)\n"
          "print('tensorflow loaded:', 'tensorflow' in sys.modules, rc)")
  out = subprocess.run([sys.executable, "-c", code, "--compare", a, b],
                       capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "A [CPU A] | B [CPU B]" in out.stdout
  assert "tensorflow loaded: False 0" in out.stdout
  missing = subprocess.run(
      [sys.executable, "-m", "tfmgpu.bench", f"--compare={a},{tmp_path}/x.csv"],
      capture_output=True, text=True, timeout=120, check=False)
  assert missing.returncode == 1
  assert "error: --compare file" in missing.stderr


def test_bench_cli_says_in_one_line_what_it_cannot_run():
  """A mistyped section or replica count, or more replicas than
  `--virtual_devices` makes: one `error:` line naming the flag and the
  choices, exit 1, before TensorFlow loads (no traceback)."""
  for args, said in (
      (["--sections=training,tf-data"], "--sections=training,tf-data: "
       "tf-data is not a section. Choose from training, ceiling"),
      (["--replicas=1,two"], "--replicas=1,two must be whole numbers of at "
       "least 1, e.g. --replicas=1,2,4."),
      (["--replicas=1,4", "--virtual_devices=2"], "--replicas=1,4 needs 4 "
       "devices but --virtual_devices=2 makes 2. Give --virtual_devices=4 "
       "or more")):
    out = subprocess.run([sys.executable, "-m", "tfmgpu.bench", *args],
                         capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"error: {said}"), out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_cli_runs_a_section(tmp_path):
  env = dict(os.environ, TFMGPU_CACHE_DIR=str(tmp_path / "cache"))
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  out = subprocess.run(
      [sys.executable, "-m", "tfmgpu.bench", "--quick", "--models=mlp",
       "--replicas=2", "--sections=training,projection",
       "--steps_per_execution=2", f"--output_dir={tmp_path}"], capture_output=True, text=True,
      timeout=900, check=False, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "tfmgpu/keras_fit mlp x2" in out.stdout
  assert "keras_fit_fused" not in out.stdout  # --quick: the targets' paths.
  assert "thread(s) per op" in out.stdout
  assert "Projection (not a measurement)" in out.stdout
  cpu = autotune.cpu_model()
  headers = [l for l in out.stdout.splitlines() if l.startswith("== ")]
  assert len(headers) == 4 and all(f"[{cpu}] ==" in h for h in headers)
  assert headers[-1].startswith("== Targets: ")
  # --quick reads the autotune's cache and measures nothing.
  assert re.search(r"^  mlp +2 not cached  defaults", out.stdout, re.M)
  assert not (tmp_path / "cache" / autotune.CACHE_FILE).exists()
  assert re.search(r"tfmgpu/keras_fit mlp x2 +\d\.\d{3} \(\d\.\d\d-\d\.\d\d\)",
                   out.stdout)
  assert re.search(r"^  (held  |MISSED) tfmgpu/keras_fit mlp x2 .* target >= "
                   r"1\.20", out.stdout, re.M)
  assert re.search(r"^  (held  |MISSED) bench --quick wall time, s .* target "
                   r"<= 150, on 2 quiet cores", out.stdout, re.M)
  assert re.search(r"^Suite took \d+ s wall, \d+ s CPU \(this process and "
                   r"its children\); by "
                   r"section, wall / CPU s: training \d+ / \d+, projection "
                   r"\d+ / \d+;", out.stdout, re.M)
  assert out.stderr == "", out.stderr[-3000:]  # Tables only: no log line.
  rows = list(csv.DictReader(open(tmp_path / "results.csv")))
  assert {r["cpu"] for r in rows} == {cpu}
  assert (tmp_path / "throughput.png").exists()


def test_predictors_built_in_a_row_trace_once_each_without_a_warning(caplog):
  """The bench's predict-options table builds one Predictor per option:
  each traces its function once, and TF does not report retracing (it did
  from the fifth, every Predictor's function sharing one code object)."""
  import logging  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfmgpu import inference, strategies  # pylint: disable=g-import-not-at-top
  strategy = strategies.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(8,), num_classes=3,
                               width=8, seed=0)
  x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
  predictors = []
  with caplog.at_level(logging.WARNING, logger="tensorflow"):
    for batch_size in (16, 32, 16, 32, 16, 32):
      predictor = inference.Predictor(model, strategy=strategy,
                                      batch_size=batch_size)
      for _ in range(2):
        predictor.predict(x)
      predictors.append(predictor)
  assert "retracing" not in caplog.text
  assert [p._fn.experimental_get_tracing_count()  # pylint: disable=protected-access
          for p in predictors] == [1] * 6


def test_the_tf_data_section_times_tfmgpu_fit_and_orbit_on_one_dataset():
  from tfmgpu import data
  from tfmgpu.benchmarks import orbit as orbit_lib
  arrays = data.load_dataset("digits8x8")
  calls = []

  def runner(name, gap):
    def run():
      calls.append(name)
      return [0.0, gap, 2 * gap, 3 * gap]  # Call end times: steady gaps.
    return run

  runners = {"a": runner("a", 0.5), "b": runner("b", 0.25), "missing": None}
  rates = orbit_lib.best_rates(runners, examples_per_call=100, rounds=2)
  assert calls == ["a", "b"] + ["a", "b"] * 2  # A warm run, then interleaved.
  assert rates == {"a": 200.0, "b": 400.0, "missing": None}
  row = orbit_lib.compare("mlp", arrays, replicas=2, global_batch_size=32,
                          steps=4, steps_per_execution=2, rounds=1)
  assert row.tfmgpu > 0 and row.keras_fit > 0 and row.tfmgpu_tf_iterator > 0
  assert row.host_split_gain == row.tfmgpu / row.tfmgpu_tf_iterator
  try:
    import orbit  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    assert row.orbit is None
    assert "not installed" in orbit_lib.table([row])
  else:
    assert row.orbit > 0 and row.vs_orbit > 0


def test_latency_times_each_request_of_fresh_rows():
  from tfmgpu.benchmarks import inference as bench_inference  # pylint: disable=g-import-not-at-top
  x = np.arange(100)[:, None].astype(np.float32)
  seen = []
  lat = bench_inference.latency("fake", lambda b: seen.append(b[:, 0].copy()),
                                x, rows=8, calls=20)
  assert (lat.path, lat.rows, lat.calls) == ("fake", 8, 20)
  assert len(seen) == 21 and all(len(b) == 8 for b in seen)  # + warm-up.
  assert len({tuple(b) for b in seen[1:]}) > 1  # Not one cached request.
  assert 0 <= lat.p50_ms <= lat.p99_ms


def test_language_model_layouts_fit_the_devices_and_name_their_options():
  from tfmgpu.benchmarks import language_model  # pylint: disable=g-import-not-at-top
  two = language_model.layouts(2)
  assert [l.label for l in two] == [
      "one_device", "mirrored x2", "model_parallel x2",
      "pipeline x2 M=4 gpipe", "pipeline x2 M=4 1f1b"]
  four = {l.label: l for l in language_model.layouts(4)}
  assert four["pipeline x4 M=8 gpipe"].options == {
      "num_stages": 4, "micro_batches": 8, "schedule": "gpipe"}
  assert all(l.devices <= 4 for l in four.values()) and "mirrored x4" in four


def test_a_child_process_returns_its_result_or_says_how_it_failed():
  from tfmgpu.benchmarks import child  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top
  kwargs = {"size": "tiny", "vocab": 256, "context": 64}

  def count_then_fail(failed: str) -> None:
    assert child.call_in_child("tfmgpu.models.gpt:parameter_count", kwargs,
                               timeout_s=300, what="the count",
                               alone="count") == gpt.parameter_count(**kwargs)
    with pytest.raises(RuntimeError) as e:
      child.call_in_child("tfmgpu.models.gpt:resolve_size", {"size": "huge"},
                          timeout_s=300, what="the size check",
                          alone="python -m size")
    assert failed + "; run `python -m size` alone" in str(e.value)
    assert "size='huge' is not a gpt size" in str(e.value)

  count_then_fail("the size check process failed (exit 1)")  # A process each.
  # A shared child serves the calls in turn, and goes on after a failure.
  with child.shared_process(preload=("tfmgpu.models.gpt",)) as shared:
    child.wait_ready()
    count_then_fail("the size check process failed")
    # A call that leaves a line unfinished on stdout still gets its answer.
    assert child.call_in_child("builtins:print", {"end": "no newline"},
                               timeout_s=300, what="the print",
                               alone="print") is None
    assert child.shared_cpu_seconds() > 0
    # A child that dies mid-call says so, with its exit code, every time.
    for _ in range(2):
      with pytest.raises(RuntimeError, match=r"the exit process failed \(exit "
                         r"3\); run `exit` alone to see why"):
        child.call_in_child("os:_exit", {"status": 3}, timeout_s=300,
                            what="the exit", alone="exit")
  assert shared._proc.poll() == 3  # pylint: disable=protected-access
  assert child.shared_cpu_seconds() == 0  # None shared any more.


def test_the_one_device_language_model_measures_fit_and_tfmgpu_alike(
    monkeypatch):
  """`measure_one_device` (what the bench's child process runs) times
  both paths and returns what the parent rebuilds its timings from. Its
  matmul ceiling runs at n=256 (the same code; the default 1024 took 2 s)."""
  from tfmgpu.benchmarks import language_model  # pylint: disable=g-import-not-at-top
  real_gflops = ceiling.matmul_gflops
  monkeypatch.setattr(ceiling, "matmul_gflops",
                      lambda: real_gflops(n=256))
  result = language_model.measure_one_device(
      size="tiny", seq_len=16, global_batch_size=8, steps=2,
      steps_per_execution=2, rounds=1, autotune=False, cached_only=True)
  assert result["autotune"] is None and result["matmul_gflops"] > 0
  assert set(result["timings"]) == {"keras_fit", "one_device"}
  for timing in result["timings"].values():
    assert timing["ms_per_step"] > 0 and len(timing["rounds_ms"]) == 1
    assert timing["global_batch_size"] == 8


def test_hybrid_layouts_name_their_placements_and_fit_their_groups():
  from tfmgpu.benchmarks import hybrid  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel.hybrid import Layout  # pylint: disable=g-import-not-at-top
  assert {n: [hybrid.label(l) for l in ls]
          for n, ls in hybrid.LAYOUTS.items()} == {
              4: ["data 4 (mirrored)", "tensor 2", "tensor 4",
                  "data 2 x tensor 2", "pipeline 2 (M=4) x tensor 2",
                  "data 2 x pipeline 2 (M=4)"],
              8: ["data 8 (mirrored)",
                  "data 2 x pipeline 2 (M=4) x tensor 2",
                  "data 4 x tensor 2", "pipeline 4 (M=8) x tensor 2"]}
  for n, layouts in hybrid.LAYOUTS.items():
    assert layouts[0] == hybrid.reference(n)
    assert all(l.num_devices <= n and 64 % (l.data * (l.micro_batches or 1))
               == 0 for l in layouts)
  placed = hybrid.placement_of(Layout(data=2, stages=2, tensor=2,
                                      micro_batches=4))
  assert (placed.strategy, placed.options) == ("pipeline", {
      "num_stages": 2, "data_parallel": 2, "tensor_parallel": 2,
      "micro_batches": 4, "schedule": "gpipe", "recompute": False})
  assert hybrid.placement_of(Layout(data=4, tensor=2)).options == {
      "tensor_parallel": 2, "data_parallel": 4}
  assert hybrid.placement_of(Layout(data=8)).options == {"num_replicas": 8}
  assert hybrid.placement_of(Layout(stages=2)).strategy == "model_parallel"
  fit, skipped = hybrid.groups(4)
  assert list(fit) == [4] and skipped == [8]


def test_the_layout_projection_all_reduces_as_the_data_parallel_one():
  from tfmgpu.parallel import links  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel.hybrid import Layout  # pylint: disable=g-import-not-at-top
  gpt = models.build_model("gpt", input_shape=(16,), num_classes=256,
                           size="tiny", seed=0)
  host = links.host("dgx_a100")
  four = projection.project_layout(gpt, Layout(data=4), global_batch_size=8)
  ring = projection.project_data_parallel(0.0, projection.gradient_bytes(gpt),
                                          4, host.link)
  assert four.step.data_s * 1e3 == pytest.approx(ring.allreduce_ms)
  assert four.step.tensor_s == four.step.pipeline_s == 0 and four.fits
  split = projection.project_layout(gpt, Layout(data=2, tensor=2),
                                    global_batch_size=8)
  assert split.step.tensor_s > 0 and split.step.data_s < four.step.data_s
  assert split.memory_bytes == int(host.memory_gb * 1e9)


def test_the_hybrid_section_times_each_layout_against_data_parallelism(
    monkeypatch):
  """Quick mode, a smaller table (tracing each layout is the cost): rows
  for the groups that fit the 4 devices, a note for the 8 that do not."""
  from tfmgpu.benchmarks import hybrid, sections  # pylint: disable=g-import-not-at-top
  from tfmgpu.benchmarks.options import SuiteOptions  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel.hybrid import Layout  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(hybrid, "LAYOUTS", {
      2: (Layout(data=2), Layout(tensor=2),
          Layout(stages=2, micro_batches=2)),
      8: (Layout(data=8),)})
  lines = []
  report = report_lib.Report(out=lines.append, cpu="Test CPU")
  sections.SECTIONS["hybrid"](report, SuiteOptions(quick=True, rounds=2),
                              None)
  text = "\n".join(lines)
  assert "gpt tiny (num_heads=4, num_layers=1)" in text
  assert ("8-device layouts skipped: this process has 4 logical devices"
          in text)
  assert [(r.section, r.replicas, r.path) for r in report.rows] == [
      ("hybrid", 2, "data 2 (mirrored)"), ("hybrid", 2, "tensor 2"),
      ("hybrid", 2, "pipeline 2 (M=2)")]
  for row in report.rows:
    assert np.isfinite(row.ms_per_step) and row.ms_per_step > 0
    assert len(row.rounds_ms) == 2 and row.examples_per_sec == (
        pytest.approx(64 * 64 * 1e3 / row.ms_per_step))
    ratio, projected = re.search(
        r"vs data 2 x(\S+); projected dgx_a100 \S+ ms/step \(x(\S+)\)",
        row.note).groups()
    assert np.isfinite(float(ratio)) and np.isfinite(float(projected))
  tensor, = [l for l in lines if l.lstrip().startswith("tensor 2 ")]
  assert re.search(r"2 of 2 .* \d\.\d\d \(\d\.\d\d-\d\.\d\d\) +\|", tensor)


def test_verdicts_say_held_or_missed_with_the_spread():
  lines = []
  report = report_lib.Report(out=lines.append, cpu="Test CPU")
  target = report_lib.Target(1.2)
  report.figure("tfmgpu/keras_fit mlp x2", 1.25, spread=(1.22, 1.31),
                target=target)
  report.figure("tfmgpu/keras_fit mlp x4", 1.25, spread=(1.10, 1.31),
                target=target)
  report.figure("tfmgpu/keras_fit mlp x1", 0.98, spread=(0.90, 1.21),
                target=report_lib.Target(1.0))
  report.figure("predict x4", 0.7, target=report_lib.Target(1.0))
  report.figure("bench --quick wall time, s", 161.0, target=report_lib.Target(
      150, at_least=False, why="on 2 quiet cores"))
  report.figure("cost / floor", 1.05, spread=(1.02, 1.12),
                target=report_lib.Target(1.10, at_least=False))
  report.figure("no target", 3.0, "(measured)")
  assert lines[0].split()[-5:] == ["1.250", "(1.22-1.31)", "(target", ">=",
                                  "1.20)"]
  lines.clear()
  report.say_verdicts()
  assert lines[0] == ("\n== Targets: 3 of 6 held (verdict: the best rounds' "
                      "figure; spread: one round's pair) [Test CPU] ==")
  held, shaky, missed, never, slow, under = [l.split(None, 1) for l in
                                             lines[1:]]
  assert [v[0] for v in (held, shaky, missed, never, slow, under)] == [
      "held", "held", "MISSED", "MISSED", "MISSED", "held"]
  assert held[1].endswith("1.250 (1.22-1.31)    target >= 1.20")
  assert shaky[1].endswith("target >= 1.20; one round's pair missed it "
                           "(1.10)")
  assert missed[1].endswith("target >= 1.00; one round's pair held it "
                            "(1.21)")
  assert never[1].endswith("0.700                target >= 1.00")
  assert slow[1].endswith("target <= 150, on 2 quiet cores")
  assert under[1].endswith("target <= 1.10; one round's pair missed it "
                           "(1.12)")
  assert len(report.verdicts()) == 6  # "no target" has none.


def test_quick_runs_the_sections_with_targets_and_reads_the_autotune(
    monkeypatch):
  """--quick's plan, without timing anything: its default sections, and
  the autotune asked for cached choices only."""
  from tfmgpu.benchmarks import options, sections  # pylint: disable=g-import-not-at-top
  assert set(options.QUICK_SECTIONS) <= set(sections.SECTIONS)
  assert set(options.DEFAULT_SECTIONS + options.ON_REQUEST_SECTIONS) == set(
      sections.SECTIONS)
  asked = []

  def fake_tune(*args, cached_only=False, **kwargs):
    asked.append(cached_only)
    return autotune.Choice(kwargs["current"], kwargs["current"], {},
                           "not cached", "not cached")

  monkeypatch.setattr(autotune, "tune_training", fake_tune)
  monkeypatch.setattr(sections, "_mirrored", lambda replicas: None)
  for quick in (True, False):
    report = report_lib.Report(out=lambda s: None, cpu="X")
    sections._autotune(report, options.SuiteOptions(  # pylint: disable=protected-access
        models=("mlp",), replicas=(1,), quick=quick),
                       types.SimpleNamespace(x_train=None, y_train=None))
  assert asked == [True, False]


def test_a_run_without_the_training_table_writes_no_throughput_plot(
    tmp_path):
  pytest.importorskip("matplotlib")
  from tfmgpu.benchmarks import options, plots  # pylint: disable=g-import-not-at-top
  opts = options.SuiteOptions(output_dir=str(tmp_path), replicas=(1, 2))
  report = report_lib.Report(out=lambda s: None, cpu="X")
  report.add(report_lib.Row("latency", "convnet", 1, "one_device tfmgpu",
                            1.0, 1000.0))
  written = plots.write_plots(report, opts)
  assert not (tmp_path / "throughput.png").exists()
  assert all(os.path.exists(p) for p in written) and written
  report.add(report_lib.Row("training", "mlp", 1, "tfmgpu", 1.0, 64000.0))
  plots.write_plots(report, opts)
  assert (tmp_path / "throughput.png").exists()


def test_pipeline_overlap_times_interleaved_1f1b_beside_its_simulation():
  """The plumbing of the bench's interleaved run (times not asserted): the
  M=4 setting is simulated per device with 2 stages each, M=1 in order."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu.benchmarks import pipeline_overlap  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import demo  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = demo.deep_mlp((12,), 3, depth=4, width=8)
  plan = partition.plan_stages(model, 4, devices=["/cpu:0", "/cpu:1"] * 2)
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(8, 12)).astype(np.float32))
  y = tf.constant(rng.integers(0, 3, size=8))

  def loss_fn(y_true, y_pred):
    return tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True)) / 8.0

  run = pipeline_overlap.compare_micro_batches(
      model, plan, x, y, loss_fn, micro_batches=4, schedule="1f1b",
      steps=1, warmup=0, virtual_stages=2, concurrency=1.0)
  assert run.num_stages == 2 and run.virtual_stages == 2
  many, one = run.results[4], run.results[1]
  # Calibrated: the same stage times with the devices taking turns, the
  # concurrency counted in stages of the cores one keeps busy alone.
  from tfmgpu.parallel import timeline as timeline_lib  # pylint: disable=g-import-not-at-top
  assert many.stage_cores >= 1.0
  turns = timeline_lib.simulate(many.fwd, many.bwd, 4, schedule="1f1b",
                                virtual_stages=2, send_time=run.send_s,
                                concurrency=1.0 / many.stage_cores)
  assert many.calibrated == pytest.approx(turns.step_time + many.update)
  assert many.timeline.virtual_stages == 2 and len(many.busy) == 2
  assert one.timeline.virtual_stages == 1 and len(one.busy) == 2
  assert 0.0 <= many.timeline.bubble_fraction < 1.0


def test_the_zero_section_reads_the_bytes_each_device_holds(monkeypatch):
  """Quick mode on the 4 logical devices: mirrored, stage 1 and stage 3
  timed side by side; the fullest device's weights and slots read from
  the variables fall to about (1 + 2/4) / 3 (stage 1: Adam's two slots
  sharded) and 1/4 (stage 3) of mirrored's. Shorter windows and batches
  than the bench's (the bytes held do not depend on them)."""
  from tfmgpu.benchmarks import sections  # pylint: disable=g-import-not-at-top
  from tfmgpu.benchmarks import zero  # pylint: disable=g-import-not-at-top
  from tfmgpu.benchmarks.options import SuiteOptions  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(zero, "SEQ_LEN", 16)
  lines = []
  report = report_lib.Report(out=lines.append, cpu="Test CPU")
  sections.SECTIONS["zero"](report, SuiteOptions(quick=True, rounds=2,
                                                 global_batch_size=16), None)
  assert [(r.section, r.replicas, r.path) for r in report.rows] == [
      ("zero", 4, "mirrored x4"), ("zero", 4, "zero 1 x4"),
      ("zero", 4, "zero 3 x4")]
  for row in report.rows:
    assert np.isfinite(row.ms_per_step) and len(row.rounds_ms) == 2
  fractions = {r.path: float(re.search(r"\((\S+) of mirrored\)",
                                       r.note).group(1))
               for r in report.rows}
  assert fractions["zero 1 x4"] == pytest.approx(0.5, abs=0.05)
  assert fractions["zero 3 x4"] == pytest.approx(0.25, abs=0.05)


def test_the_expected_time_says_when_onednn_is_off(monkeypatch):
  """The quick run's "about 2.5 minutes" was measured with TensorFlow's
  oneDNN kernels; on a CPU where TF leaves them off it took 8."""
  from tfmgpu import _compat
  from tfmgpu.benchmarks import suite
  monkeypatch.setattr(_compat, "onednn_enabled", lambda: False)
  assert suite._slower_kernels().startswith(
      " with TensorFlow's oneDNN kernels; they are off here, which made "
      "--quick take 8 minutes")
  for state in (True, None):  # On, or a TensorFlow that cannot say.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda s=state: s)
    assert suite._slower_kernels() == ""
