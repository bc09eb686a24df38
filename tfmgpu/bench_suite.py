"""The benchmark suite behind `python -m tfmgpu.bench`: runs, tables, CSV, plots.

Everything is measured side by side in one process (paths interleaved) and
reported as ratios; projections for multi-GPU hosts are labelled as such.
The measurement primitives live in `tfmgpu.benchmark`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Sequence

from absl import logging
import numpy as np

from tfmgpu import benchmark
from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
  """What the suite runs.

  Attributes:
    models: registered model names to train.
    replicas: replica counts for `mirrored` (needs that many devices).
    steps: timed steps per run; quick mode uses fewer.
    global_batch_size: examples per step.
    steps_per_execution: for tfmgpu and Keras fit alike (matched).
    rounds: interleaved repetitions per path (best kept).
    output_dir: CSV and PNG go here.
    quick: fewer steps and sections, for a run under 5 minutes.
  """
  models: tuple[str, ...] = ("convnet", "mlp")
  replicas: tuple[int, ...] = (1, 2, 4)
  steps: int = 120
  global_batch_size: int = 64
  steps_per_execution: int = 10
  rounds: int = 2
  output_dir: str = "bench_results"
  quick: bool = False


@dataclasses.dataclass
class Row:
  section: str
  model: str
  replicas: int
  path: str
  ms_per_step: float
  examples_per_sec: float
  note: str = ""


class Report:
  """Collects rows, prints sections as they finish, writes CSV/plots."""

  def __init__(self, out: Any = print):
    self.rows: list[Row] = []
    self.figures: dict[str, float] = {}
    self._out = out

  def add(self, row: Row) -> None:
    self.rows.append(row)

  def say(self, text: str = "") -> None:
    self._out(text)

  def figure(self, name: str, value: float, rule: str = "") -> None:
    """Records a headline figure (a ratio or fraction) and prints it."""
    self.figures[name] = value
    self.say(f"  {name:<52} {value:8.3f}  {rule}")

  def write_csv(self, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow([f.name for f in dataclasses.fields(Row)])
      for r in self.rows:
        writer.writerow([getattr(r, f.name) for f in dataclasses.fields(Row)])
    return path


def machine_description() -> str:
  """One line: CPU, cores, Python, TF and Keras versions, logical devices and
  threads per op."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  threads = tf.config.threading.get_intra_op_parallelism_threads()
  return (f"{cpu}; {os.cpu_count()} cores; Python {platform.python_version()}; "
          f"TensorFlow {tf.__version__}; Keras {keras.__version__}; "
          f"{len(devices_lib.accelerator_devices())} logical devices, "
          f"{threads or 'all'} thread(s) per op")


def _training(report: Report, opts: SuiteOptions, arrays) -> None:
  report.say("\n== Training throughput: same model, data, strategy and batch ==")
  report.say(f"{'model':<8} {'replicas':>8} {'path':<18} {'ms/step':>9} "
             f"{'examples/s':>11} {'vs fit':>7}")
  for model in opts.models:
    for replicas in opts.replicas:
      strategy = strategies_lib.get_strategy("mirrored", num_replicas=replicas)
      paths = ["tfmgpu", "keras_fit", "keras_fit_fused", "tutorial"]
      best = benchmark.compare(
          strategy, model, arrays, global_batch_size=opts.global_batch_size,
          steps=opts.steps, steps_per_execution=opts.steps_per_execution,
          rounds=opts.rounds, paths=paths)
      if replicas == 1:
        for same_kernels in (False, True):
          floor = min(
              (benchmark.time_floor(
                  model, arrays, global_batch_size=opts.global_batch_size,
                  steps=opts.steps, same_kernels=same_kernels,
                  steps_per_execution=opts.steps_per_execution)
               for _ in range(opts.rounds)), key=lambda t: t.ms_per_step)
          best[floor.path] = floor
      fit = best["keras_fit"].examples_per_sec
      for path, t in best.items():
        report.add(Row("training", model, replicas, path, t.ms_per_step,
                       t.examples_per_sec))
        report.say(f"{model:<8} {replicas:>8} {path:<18} {t.ms_per_step:>9.2f} "
                   f"{t.examples_per_sec:>11,.0f} {t.examples_per_sec / fit:>7.2f}")
      report.figure(f"tfmgpu/keras_fit {model} x{replicas}",
                    best["tfmgpu"].examples_per_sec / fit,
                    "(target >= 1.0)" if replicas == 1 else "(target >= 1.2)")
      if "floor" in best:
        report.figure(f"tfmgpu cost / floor {model} x1",
                      best["tfmgpu"].ms_per_step / best["floor"].ms_per_step,
                      "(target <= 1.10)")
        report.figure(f"tfmgpu cost / floor with its kernels {model} x1",
                      best["tfmgpu"].ms_per_step
                      / best["floor_same_kernels"].ms_per_step,
                      "(the loop's own cost)")


def measure_ceiling(models: Sequence[str], *, global_batch_size: int,
                    steps: int, steps_per_execution: int,
                    arrays: data_lib.Arrays | None = None) -> dict[str, Any]:
  """The matmul ceiling and each model's single-device training FLOP/s,
  through tfmgpu's loop and the bare loop.

  Returns:
    `{"gflops": ceiling, "runs": [{"model", "batch", "path", "ms_per_step",
    "examples_per_sec", "achieved_gflops"}, ...]}` (JSON-ready).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if arrays is None:  # A child process loads the suite's data itself.
    arrays = data_lib.load_dataset("digits")
  result: dict[str, Any] = {"gflops": benchmark.matmul_gflops(), "runs": []}
  for model_name in models:
    model = models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                   num_classes=arrays.num_classes)
    flops = benchmark.training_flops_per_example(model)
    for batch in (global_batch_size, 1024):
      big = batch > 256
      kwargs = dict(global_batch_size=batch,
                    steps=max(steps // 4, 8) if big else steps,
                    steps_per_execution=2 if big else steps_per_execution)
      for t in (benchmark.time_tfmgpu(tf.distribute.get_strategy(),
                                      model_name, arrays, **kwargs),
                benchmark.time_floor(model_name, arrays, **kwargs)):
        result["runs"].append(dict(
            model=model_name, batch=batch, path=t.path,
            ms_per_step=t.ms_per_step, examples_per_sec=t.examples_per_sec,
            achieved_gflops=flops * t.examples_per_sec / 1e9))
  return result


# A single device gets every core; this process may have split the CPU.
_CEILING_CHILD = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from tfmgpu import bench_suite
print("CEILING_JSON " + json.dumps(bench_suite.measure_ceiling(
    **json.loads(sys.argv[1]))))
"""


def _ceiling_in_child(timeout_s: int = 900, **kwargs) -> dict[str, Any]:
  try:
    out = subprocess.run([sys.executable, "-c", _CEILING_CHILD,
                          json.dumps(kwargs)], capture_output=True, text=True,
                         timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(
        f"the ceiling measurement process took over {timeout_s} s; run "
        "`python -m tfmgpu.bench --sections=ceiling --replicas=1 "
        "--virtual_devices=1` alone to see why.") from e
  for line in out.stdout.splitlines():
    if line.startswith("CEILING_JSON "):
      return json.loads(line.split(" ", 1)[1])
  raise RuntimeError("the ceiling measurement process failed "
                     f"(exit {out.returncode}): {out.stderr[-2000:]}")


def _ceiling(report: Report, opts: SuiteOptions, arrays) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report.say("\n== Compute ceiling: achieved FLOP/s vs float32 matmul ==")
  kwargs = dict(models=list(opts.models),
                global_batch_size=opts.global_batch_size, steps=opts.steps,
                steps_per_execution=opts.steps_per_execution)
  threads = tf.config.threading.get_intra_op_parallelism_threads()
  if threads and threads < devices_lib.cpu_cores():
    report.say(f"  (single-device training gets every core: measured in a "
               f"fresh process; this one gives each op {threads} thread(s) "
               "so that its logical devices share the cores)")
    result = _ceiling_in_child(**kwargs)
  else:
    result = measure_ceiling(**kwargs, arrays=arrays)
  gflops = result["gflops"]
  report.say(f"  float32 matmul ceiling: {gflops:,.1f} GFLOP/s "
             f"({devices_lib.cpu_cores()} cores busy)")
  for run in result["runs"]:
    achieved = run["achieved_gflops"]
    report.add(Row("ceiling", run["model"], 1,
                   f"{run['path']}_b{run['batch']}", run["ms_per_step"],
                   run["examples_per_sec"], f"{achieved:.1f} GFLOP/s"))
    report.figure(f"{run['model']} batch {run['batch']} {run['path']}: "
                  "fraction of ceiling", achieved / gflops,
                  f"({achieved:.1f} of {gflops:.1f} GFLOP/s; mlp target >= "
                  "0.60)")


def _optimisations(report: Report, opts: SuiteOptions, arrays) -> None:
  report.say("\n== Optimisations, each on/off (mlp, tfmgpu loop; best of "
             f"{opts.rounds} interleaved rounds) ==")
  report.say("  (baseline: tfmgpu's defaults, fused optimizer and device-"
             "resident data on; 'off:' rows turn one off)")
  replicas = max(r for r in opts.replicas if r <= 2)
  spe = opts.steps_per_execution
  variants = {
      f"baseline (steps_per_execution={spe})": {},
      "steps_per_execution=1": dict(steps_per_execution=1),
      "jit_compile (XLA per replica)": dict(jit_compile=True),
      "gradient_compression=float16": dict(gradient_compression="float16"),
      "bytes_per_pack=64KiB": dict(bytes_per_pack=64 * 1024),
      "off: fused_optimizer=False": dict(fused_optimizer=False),
      "off: input_mode=tf_data": dict(input_mode="tf_data"),
  }
  strategies = {
      "mirrored": strategies_lib.get_strategy("mirrored", num_replicas=replicas),
      "mirrored x1": strategies_lib.get_strategy(
          "mirrored", num_replicas=1, single_replica="mirrored"),
      "mirrored x1 collapsed": strategies_lib.get_strategy(
          "mirrored", num_replicas=1),
      "one_device": strategies_lib.get_strategy("one_device"),
      "default": strategies_lib.get_strategy("default"),
  }
  runs = [(name, "mirrored", kw) for name, kw in variants.items()] + [
      ("one replica: mirrored x1", "mirrored x1", {}),
      ("one replica: mirrored x1, single_replica=default",
       "mirrored x1 collapsed", {}),
      ("one replica: one_device", "one_device", {}),
      ("one replica: default strategy", "default", {})]
  best: dict[str, benchmark.Timing] = {}
  for _ in range(opts.rounds):
    for name, strategy, kwargs in runs:
      kwargs = {"steps_per_execution": spe, **kwargs}
      t = benchmark.time_tfmgpu(strategies[strategy], "mlp", arrays,
                                global_batch_size=opts.global_batch_size,
                                steps=opts.steps, **kwargs)
      if name not in best or t.ms_per_step < best[name].ms_per_step:
        best[name] = t
  base = best[f"baseline (steps_per_execution={spe})"]
  for name, strategy, _ in runs:
    t = best[name]
    n = 1 if strategy != "mirrored" else replicas
    report.add(Row("optimisation", "mlp", n, name, t.ms_per_step,
                   t.examples_per_sec))
    ref = base if strategy == "mirrored" else best[
        "one replica: default strategy"]
    report.say(f"  x{n} {name:<34} {t.ms_per_step:8.2f} ms/step "
               f"{t.examples_per_sec:>10,.0f} ex/s  speed-up "
               f"{ref.ms_per_step / t.ms_per_step:5.2f}")
  report.figure("one replica: mirrored cost / default strategy cost",
                best["one replica: mirrored x1"].ms_per_step
                / best["one replica: default strategy"].ms_per_step,
                "(> 1 is MirroredStrategy overhead)")


def _compression_accuracy(report: Report, opts: SuiteOptions, arrays) -> None:
  from tfmgpu.training import allreduce  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  report.say("\n== Gradient compression: bytes and accuracy (convnet, x2) ==")
  epochs = 3 if opts.quick else 5
  accuracy, sent = {}, {}
  for compression in ("none", "float16"):
    strategy = strategies_lib.get_strategy("mirrored", num_replicas=2)
    with strategy.scope():
      model = models_lib.build_model("convnet", input_shape=arrays.input_shape,
                                     num_classes=arrays.num_classes, seed=0)
    trainer = Trainer(model, strategy=strategy, learning_rate=2e-3,
                      steps_per_execution=10, verbose=0,
                      gradient_compression=compression)
    trainer.fit(arrays.x_train, arrays.y_train, epochs=epochs,
                global_batch_size=64)
    accuracy[compression] = trainer.evaluate(arrays.x_test, arrays.y_test)[
        "accuracy"]
    sent[compression] = allreduce.all_reduced_bytes(model.trainable_variables,
                                                    compression)
    report.say(f"  {compression:<8} all-reduced {sent[compression]:>9,} "
               "bytes/step/replica"
               f"   test accuracy {accuracy[compression]:.4f}")
  report.figure("compressed / full all-reduced bytes",
                sent["float16"] / sent["none"], "(target 0.5)")
  report.figure("accuracy points lost to float16 compression",
                100 * (accuracy["none"] - accuracy["float16"]),
                "(target <= 0.5)")


def _inference(report: Report, opts: SuiteOptions, arrays) -> None:
  report.say("\n== Inference: tfmgpu.predict vs Keras predict (convnet) ==")
  x = arrays.x_train
  for replicas in opts.replicas:
    strategy = strategies_lib.get_strategy("mirrored", num_replicas=replicas)
    best = benchmark.compare_predict(strategy, "convnet", x,
                                     rounds=2 if opts.quick else 3)
    for path, t in best.items():
      report.add(Row("inference", "convnet", replicas, path, t.ms_per_step,
                     t.examples_per_sec))
    report.say(f"  x{replicas}: tfmgpu {best['tfmgpu'].examples_per_sec:>9,.0f}"
               f" ex/s, keras {best['keras_predict'].examples_per_sec:>9,.0f}"
               " ex/s")
    report.figure(f"tfmgpu.predict/keras predict x{replicas}",
                  best["tfmgpu"].examples_per_sec
                  / best["keras_predict"].examples_per_sec, "(target >= 1.0)")
  replicas = max(r for r in opts.replicas if r <= 2)
  strategy = strategies_lib.get_strategy("mirrored", num_replicas=replicas)
  report.say(f"  inference options, x{replicas} (each on/off):")
  for name, options in {
      "batch 1024, steps_per_execution=4 (defaults)": {},
      "steps_per_execution=1": dict(steps_per_execution=1),
      "batch 128": dict(batch_size=128),
      "precision=bfloat16": dict(precision="bfloat16"),
  }.items():
    t = benchmark.time_predictor(strategy, "convnet", x, **options)
    report.add(Row("inference_option", "convnet", replicas, name,
                   t.ms_per_step, t.examples_per_sec))
    report.say(f"    {name:<46} {t.examples_per_sec:>9,.0f} ex/s")


def _projection(report: Report, opts: SuiteOptions, arrays) -> None:
  report.say("\n== Projection (not a measurement): data parallel on N GPUs ==")
  report.say("  ring all-reduce 2(N-1)/N x bytes / link bandwidth, no overlap,"
             " compute = this machine's 1-replica step")
  floors = {r.model: r.ms_per_step for r in report.rows
            if r.section == "training" and r.path == "floor"}
  for model_name in opts.models:
    model = models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                   num_classes=arrays.num_classes)
    grad_bytes = benchmark.gradient_bytes(model)
    compute = floors.get(model_name, 1.0)
    for link in ("pcie4", "nvlink_a100"):
      cells = []
      for n in (2, 4, 8):
        p = benchmark.project_data_parallel(compute, grad_bytes, n, link)
        cells.append(f"N={n}: {p.step_ms:6.2f} ms ({p.scaling_efficiency:.0%})")
      report.say(f"  {model_name:<8} {grad_bytes / 2**20:5.2f} MiB grads "
                 f"{link:<12} " + "  ".join(cells))


def _plots(report: Report, opts: SuiteOptions) -> list[str]:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    report.say("matplotlib is not installed (pip install '.[dev]'): no plots.")
    return []
  paths = []
  fig, axes = plt.subplots(1, len(opts.models), figsize=(5 * len(opts.models), 3.5))
  axes = np.atleast_1d(axes)
  for ax, model in zip(axes, opts.models):
    for path in ("tfmgpu", "keras_fit", "keras_fit_fused", "tutorial"):
      pts = sorted((r.replicas, r.examples_per_sec) for r in report.rows
                   if r.section == "training" and r.model == model
                   and r.path == path)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=path)
    ax.set_title(f"{model}: training throughput")
    ax.set_xlabel("replicas (logical CPU devices)")
    ax.set_ylabel("examples/s")
    ax.set_xticks(list(opts.replicas))
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  fig.tight_layout()
  out = os.path.join(opts.output_dir, "throughput.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  paths.append(out)
  paths.append(_plot_stage_memory(plt, opts))
  paths.append(_plot_pipeline_timeline(opts))
  return paths


def _plot_stage_memory(plt, opts: SuiteOptions) -> str:
  """Per-device training memory of a 4-stage plan of the demo deep MLP."""
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  model = models_lib.build_model("deep_mlp", input_shape=(28, 28, 1),
                                 num_classes=10)
  stages = min(4, len(devices_lib.accelerator_devices()))
  plan = partition.plan_stages(model, stages, criterion="params")
  estimate = plan.memory_estimate(opts.global_batch_size)
  parts = ("weights", "gradients", "optimizer_slots", "activations")
  fig, ax = plt.subplots(figsize=(6, 3.5))
  bottom = np.zeros(len(estimate))
  names = [d.replace("/device:", "") for d in estimate]
  for part in parts:
    values = np.array([getattr(e, part) / 2**20 for e in estimate.values()])
    ax.bar(names, values, bottom=bottom, label=part)
    bottom += values
  ax.set_ylabel("MiB (estimate)")
  ax.set_title(f"deep_mlp in {stages} stages: memory per device "
               f"(batch {opts.global_batch_size}, Adam)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = os.path.join(opts.output_dir, "stage_memory.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def _plot_pipeline_timeline(opts: SuiteOptions) -> str:
  """The simulated GPipe timeline of 2 equal stages with 4 micro-batches."""
  from tfmgpu.parallel import schedule  # pylint: disable=g-import-not-at-top
  out = os.path.join(opts.output_dir, "pipeline_timeline.png")
  schedule.simulate([1.0, 1.0], [2.0, 2.0], 4).plot(out)
  return out


SECTIONS = {
    "training": _training,
    "ceiling": _ceiling,
    "optimisations": _optimisations,
    "compression": _compression_accuracy,
    "inference": _inference,
    "projection": _projection,
}


def run_suite(opts: SuiteOptions, *, sections: Sequence[str] = tuple(SECTIONS),
              out: Any = print) -> Report:
  """Runs the chosen sections and writes `results.csv` (+ plots)."""
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    raise ValueError(f"sections {unknown} are unknown. Choose from "
                     f"{', '.join(SECTIONS)}.")
  need = max(opts.replicas)
  have = len(devices_lib.accelerator_devices())
  if need > have:
    raise ValueError(f"replicas={list(opts.replicas)} needs {need} devices but "
                     f"{have} exist. Use --virtual_devices={need}.")
  start = time.perf_counter()
  report = Report(out)
  report.say(f"Machine: {machine_description()}")
  arrays = data_lib.load_dataset("digits")
  for name in sections:
    logging.info("bench section %s", name)
    SECTIONS[name](report, opts, arrays)
  os.makedirs(opts.output_dir, exist_ok=True)
  csv_path = report.write_csv(os.path.join(opts.output_dir, "results.csv"))
  plots = _plots(report, opts)
  report.say(f"\nWrote {csv_path}" + "".join(f", {p}" for p in plots))
  report.say(f"Suite took {time.perf_counter() - start:.0f} s.")
  return report
