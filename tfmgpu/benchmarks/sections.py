"""The suite's sections: what each one runs and the table it prints.

Each section is `section(report, opts, arrays)`: it times paths with the
primitives of `training`, `inference`, `ceiling` and `projection`, prints
its table as it goes and adds a `report.Row` per timing. `SECTIONS` maps the
names `python -m tfmgpu.bench --sections` accepts to them, in running order.
"""

from __future__ import annotations

from typing import Any, Callable

from tfmgpu import devices as devices_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu.benchmarks import ceiling as ceiling_lib
from tfmgpu.benchmarks import inference as inference_lib
from tfmgpu.benchmarks import projection as projection_lib
from tfmgpu.benchmarks import report as report_lib
from tfmgpu.benchmarks.options import SuiteOptions
from tfmgpu.benchmarks import training as training_lib


def _mirrored(replicas: int):
  return strategies_lib.get_strategy("mirrored", num_replicas=replicas)


def _floors(opts: SuiteOptions, model: str, arrays
            ) -> dict[str, training_lib.Timing]:
  """The bare loop's best round, as users write it and with tfmgpu's kernels."""
  best = {}
  for same_kernels in (False, True):
    floor = min(
        (training_lib.time_floor(
            model, arrays, global_batch_size=opts.global_batch_size,
            steps=opts.steps, same_kernels=same_kernels,
            steps_per_execution=opts.steps_per_execution)
         for _ in range(opts.rounds)), key=lambda t: t.ms_per_step)
    best[floor.path] = floor
  return best


def _training(report: report_lib.Report, opts: SuiteOptions,
              arrays) -> None:
  report.say(
      "\n== Training throughput: same model, data, strategy and batch ==")
  report.say(f"{'model':<8} {'replicas':>8} {'path':<18} {'ms/step':>9} "
             f"{'examples/s':>11} {'vs fit':>7}")
  for model in opts.models:
    for replicas in opts.replicas:
      best = training_lib.compare(
          _mirrored(replicas), model, arrays,
          global_batch_size=opts.global_batch_size, steps=opts.steps,
          steps_per_execution=opts.steps_per_execution, rounds=opts.rounds,
          paths=list(training_lib.PATHS))
      if replicas == 1:
        best.update(_floors(opts, model, arrays))
      fit = best["keras_fit"].examples_per_sec
      for path, t in best.items():
        report.add(report_lib.Row("training", model, replicas, path,
                                  t.ms_per_step, t.examples_per_sec))
        report.say(f"{model:<8} {replicas:>8} {path:<18} "
                   f"{t.ms_per_step:>9.2f} {t.examples_per_sec:>11,.0f} "
                   f"{t.examples_per_sec / fit:>7.2f}")
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


def _ceiling(report: report_lib.Report, opts: SuiteOptions,
             arrays) -> None:
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
    result = ceiling_lib.measure_ceiling_in_child(**kwargs)
  else:
    result = ceiling_lib.measure_ceiling(**kwargs, arrays=arrays)
  gflops = result["gflops"]
  report.say(f"  float32 matmul ceiling: {gflops:,.1f} GFLOP/s "
             f"({devices_lib.cpu_cores()} cores busy)")
  for run in result["runs"]:
    achieved = run["achieved_gflops"]
    report.add(report_lib.Row(
        "ceiling", run["model"], 1, f"{run['path']}_b{run['batch']}",
        run["ms_per_step"], run["examples_per_sec"], f"{achieved:.1f} GFLOP/s"))
    report.figure(f"{run['model']} batch {run['batch']} {run['path']}: "
                  "fraction of ceiling", achieved / gflops,
                  f"({achieved:.1f} of {gflops:.1f} GFLOP/s; mlp target >= "
                  "0.60)")


# The label of the runs on `replicas` mirrored replicas (the others use one).
_REPLICATED = "replicated"


def _optimisation_runs(spe: int, replicas: int
                       ) -> tuple[dict[str, Any], list[tuple[str, str, dict]]]:
  """The strategies by name, and `(row name, strategy name, Trainer options)`:
  each option on/off, then the ways to run one replica."""
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
      _REPLICATED: _mirrored(replicas),
      "mirrored x1": strategies_lib.get_strategy(
          "mirrored", num_replicas=1, single_replica="mirrored"),
      "mirrored x1 collapsed": strategies_lib.get_strategy(
          "mirrored", num_replicas=1, single_replica="default"),
      "one_device": strategies_lib.get_strategy("one_device"),
      "default": strategies_lib.get_strategy("default"),
  }
  runs = [(name, _REPLICATED, kw) for name, kw in variants.items()] + [
      ("one replica: mirrored x1", "mirrored x1", {}),
      ("one replica: mirrored x1, single_replica=default",
       "mirrored x1 collapsed", {}),
      ("one replica: one_device", "one_device", {}),
      ("one replica: default strategy", "default", {})]
  return strategies, runs


def _optimisations(report: report_lib.Report, opts: SuiteOptions,
                   arrays) -> None:
  report.say("\n== Optimisations, each on/off (mlp, tfmgpu loop; best of "
             f"{opts.rounds} interleaved rounds) ==")
  report.say("  (baseline: tfmgpu's defaults, fused optimizer and device-"
             "resident data on; 'off:' rows turn one off)")
  replicas = max(r for r in opts.replicas if r <= 2)
  spe = opts.steps_per_execution
  strategies, runs = _optimisation_runs(spe, replicas)
  best: dict[str, training_lib.Timing] = {}
  for _ in range(opts.rounds):
    for name, strategy, kwargs in runs:
      kwargs = {"steps_per_execution": spe, **kwargs}
      t = training_lib.time_tfmgpu(strategies[strategy], "mlp", arrays,
                                   global_batch_size=opts.global_batch_size,
                                   steps=opts.steps, **kwargs)
      if name not in best or t.ms_per_step < best[name].ms_per_step:
        best[name] = t
  base = best[f"baseline (steps_per_execution={spe})"]
  for name, strategy, _ in runs:
    t = best[name]
    n = replicas if strategy == _REPLICATED else 1
    report.add(report_lib.Row("optimisation", "mlp", n, name, t.ms_per_step,
                              t.examples_per_sec))
    ref = base if strategy == _REPLICATED else best[
        "one replica: default strategy"]
    report.say(f"  x{n} {name:<34} {t.ms_per_step:8.2f} ms/step "
               f"{t.examples_per_sec:>10,.0f} ex/s  speed-up "
               f"{ref.ms_per_step / t.ms_per_step:5.2f}")
  report.figure("one replica: mirrored cost / default strategy cost",
                best["one replica: mirrored x1"].ms_per_step
                / best["one replica: default strategy"].ms_per_step,
                "(> 1 is MirroredStrategy overhead)")


def _compression_accuracy(report: report_lib.Report,
                          opts: SuiteOptions, arrays) -> None:
  from tfmgpu.training import allreduce  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  report.say("\n== Gradient compression: bytes and accuracy (convnet, x2) ==")
  epochs = 3 if opts.quick else 5
  accuracy, sent = {}, {}
  for compression in ("none", "float16"):
    strategy = _mirrored(2)
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


def _inference(report: report_lib.Report, opts: SuiteOptions,
               arrays) -> None:
  report.say("\n== Inference: tfmgpu.predict vs Keras predict (convnet) ==")
  x = arrays.x_train
  for replicas in opts.replicas:
    best = inference_lib.compare_predict(_mirrored(replicas), "convnet", x,
                                         rounds=2 if opts.quick else 3)
    for path, t in best.items():
      report.add(report_lib.Row("inference", "convnet", replicas, path,
                                t.ms_per_step, t.examples_per_sec))
    report.say(f"  x{replicas}: tfmgpu {best['tfmgpu'].examples_per_sec:>9,.0f}"
               f" ex/s, keras {best['keras_predict'].examples_per_sec:>9,.0f}"
               " ex/s")
    report.figure(f"tfmgpu.predict/keras predict x{replicas}",
                  best["tfmgpu"].examples_per_sec
                  / best["keras_predict"].examples_per_sec, "(target >= 1.0)")
  replicas = max(r for r in opts.replicas if r <= 2)
  strategy = _mirrored(replicas)
  report.say(f"  inference options, x{replicas} (each on/off):")
  for name, options in {
      "batch 1024, steps_per_execution=4 (defaults)": {},
      "steps_per_execution=1": dict(steps_per_execution=1),
      "batch 128": dict(batch_size=128),
      "precision=bfloat16": dict(precision="bfloat16"),
  }.items():
    t = inference_lib.time_predictor(strategy, "convnet", x, **options)
    report.add(report_lib.Row("inference_option", "convnet", replicas, name,
                              t.ms_per_step, t.examples_per_sec))
    report.say(f"    {name:<46} {t.examples_per_sec:>9,.0f} ex/s")


def _projection(report: report_lib.Report, opts: SuiteOptions,
                arrays) -> None:
  report.say("\n== Projection (not a measurement): data parallel on N GPUs ==")
  report.say("  ring all-reduce 2(N-1)/N x bytes / link bandwidth, no overlap,"
             " compute = this machine's 1-replica step")
  floors = {r.model: r.ms_per_step for r in report.rows
            if r.section == "training" and r.path == "floor"}
  for model_name in opts.models:
    model = models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                   num_classes=arrays.num_classes)
    grad_bytes = projection_lib.gradient_bytes(model)
    compute = floors.get(model_name, 1.0)
    for link in ("pcie4", "nvlink_a100"):
      cells = []
      for n in (2, 4, 8):
        p = projection_lib.project_data_parallel(compute, grad_bytes, n, link)
        cells.append(f"N={n}: {p.step_ms:6.2f} ms ({p.scaling_efficiency:.0%})")
      report.say(f"  {model_name:<8} {grad_bytes / 2**20:5.2f} MiB grads "
                 f"{link:<12} " + "  ".join(cells))


Section = Callable[[report_lib.Report, "SuiteOptions", Any], None]

SECTIONS: dict[str, Section] = {
    "training": _training,
    "ceiling": _ceiling,
    "optimisations": _optimisations,
    "compression": _compression_accuracy,
    "inference": _inference,
    "projection": _projection,
}
