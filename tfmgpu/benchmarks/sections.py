"""The suite's sections: what each one runs and the table it prints.

Each section is `section(report, opts, arrays)`: it times paths with the
primitives of `training`, `inference`, `ceiling` and `projection`, prints
its table (headed by the CPU's name) as it goes and adds a `report.Row` per
timing; ratios carry their spread over the interleaved rounds. The training
section first runs the autotune (`tfmgpu.training.autotune`, unless
`SuiteOptions.autotune` is off) and trains the `tfmgpu` path with its
choice, every path at the chosen steps per call. `SECTIONS` maps the
names `python -m tfmgpu.bench --sections` accepts to them, in running order.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any, Callable

from tfmgpu import devices as devices_lib
from tfmgpu import inference as serving_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu.benchmarks import ceiling as ceiling_lib
from tfmgpu.benchmarks import generation as generation_lib
from tfmgpu.benchmarks import hybrid as hybrid_lib
from tfmgpu.benchmarks import inference as inference_lib
from tfmgpu.benchmarks import language_model as lm_lib
from tfmgpu.benchmarks import orbit as orbit_lib
from tfmgpu.benchmarks import pipeline_overlap as overlap_lib
from tfmgpu.benchmarks import projection as projection_lib
from tfmgpu.benchmarks import report as report_lib
from tfmgpu.benchmarks.options import SuiteOptions
from tfmgpu.benchmarks import training as training_lib
from tfmgpu.benchmarks import zero as zero_lib
from tfmgpu.training import autotune


def _mirrored(replicas: int):
  return strategies_lib.get_strategy("mirrored", num_replicas=replicas)


def _floors(opts: SuiteOptions, model: str, arrays, *, steps: int,
            steps_per_execution: int) -> dict[str, training_lib.Timing]:
  """The bare loop's best round, as users write it and with tfmgpu's kernels."""
  built = {
      name: training_lib.prepare_floor(
          model, arrays, global_batch_size=opts.global_batch_size,
          steps=steps, same_kernels=same_kernels,
          steps_per_execution=steps_per_execution)
      for name, same_kernels in (("floor", False),
                                 ("floor_same_kernels", True))}
  return training_lib.interleaved(built, opts.training_rounds)


def _build(model: str, arrays) -> Any:
  return models_lib.build_model(model, input_shape=arrays.input_shape,
                                num_classes=arrays.num_classes, seed=0)


def _defaults(opts: SuiteOptions) -> autotune.Settings:
  """tfmgpu's settings in the suite without an autotune."""
  return autotune.Settings(steps_per_execution=opts.steps_per_execution)


def _autotune(report: report_lib.Report, opts: SuiteOptions,
              arrays) -> dict[tuple[str, int], autotune.Settings]:
  """The autotune table: tfmgpu's options for each model and replica count."""
  report.header("Autotune: tfmgpu's options for each model and replica count")
  defaults = _defaults(opts)
  if not opts.autotune:
    report.say("  off (--noautotune): tfmgpu's defaults, "
               f"{autotune.changes_label(defaults.as_dict())}")
    return {}
  report.say("  (each option alone against the defaults, then the winners "
             f"together; best of {opts.rounds} interleaved rounds; a change "
             "must be 5% faster;\n   measured once per machine, model and "
             f"tfmgpu code, then read from {autotune.cache_path()}"
             + ("; --quick only reads it: a full run measures" if opts.quick
                else "") + ")")
  report.say(f"  {'model':<8} {'replicas':>8} {'source':<8}  picked: speed-up "
             "of each candidate over the defaults")
  chosen = {}
  for model in opts.models:
    for replicas in opts.replicas:
      start = time.perf_counter()
      choice = autotune.tune_training(
          functools.partial(_build, model, arrays), _mirrored(replicas),
          arrays.x_train, arrays.y_train,
          global_batch_size=opts.global_batch_size, current=defaults,
          rounds=opts.rounds, cached_only=opts.quick)
      chosen[(model, replicas)] = choice.settings
      _report_choice(report, model, replicas, choice,
                     time.perf_counter() - start, opts.global_batch_size)
  return chosen


def _report_choice(report: report_lib.Report, model: str, replicas: int,
                   choice: autotune.Choice, seconds: float,
                   global_batch_size: int) -> None:
  picked = autotune.changes_label(choice.picked)
  base = choice.times_ms.get("current")
  cells = [f"{label} {base / ms:.2f}x" for label, ms in choice.times_ms.items()
           if label != "current" and base]
  report.say(f"  {model:<8} {replicas:>8} {choice.source:<8}  "
             f"{'defaults' if picked == 'current' else picked} ({seconds:.0f} "
             f"s): {', '.join(cells) or choice.reason}")
  for label, ms in choice.times_ms.items():
    report.add(report_lib.Row(
        "autotune", model, replicas, label, ms, global_batch_size / ms * 1e3,
        "picked" if label == picked else ""))


# The paths of the training table in --quick (the ones its targets compare).
QUICK_TRAINING_PATHS = ("tfmgpu", "keras_fit")


def _training(report: report_lib.Report, opts: SuiteOptions,
              arrays) -> None:
  tuned = _autotune(report, opts, arrays)
  report.header("Training throughput: same model, data, strategy and batch")
  report.say(f"  (each path built once, then best of {opts.training_rounds} "
             "interleaved rounds; vs fit: the best rounds' ratio, then the "
             "lowest and highest ratio of one round)")
  report.say(f"{'model':<8} {'replicas':>8} {'path':<18} {'ms/step':>9} "
             f"{'examples/s':>11}  vs fit")
  for model in opts.models:
    for replicas in opts.replicas:
      settings = tuned.get((model, replicas), _defaults(opts))
      spe = settings.steps_per_execution
      steps = max(opts.steps, 8 * spe)
      best = training_lib.compare(
          _mirrored(replicas), model, arrays,
          global_batch_size=opts.global_batch_size, steps=steps,
          steps_per_execution=spe, rounds=opts.training_rounds,
          paths=list(QUICK_TRAINING_PATHS if opts.quick
                     else training_lib.PATHS),
          tfmgpu_options=training_lib.tuned_options(settings))
      if replicas == 1 and not opts.quick:
        best.update(_floors(opts, model, arrays, steps=steps,
                            steps_per_execution=spe))
      note = autotune.changes_label(_defaults(opts).changes(settings))
      _training_rows(report, model, replicas, best,
                     "" if note == "current" else note)


def _training_rows(report: report_lib.Report, model: str, replicas: int,
                   best: dict[str, training_lib.Timing], note: str) -> None:
  """One configuration's lines of the training table, and its figures."""
  fit = best["keras_fit"]
  for path, t in best.items():
    report.add(report_lib.Row("training", model, replicas, path,
                              t.ms_per_step, t.examples_per_sec,
                              note if path == "tfmgpu" else "", t.rounds_ms))
    ratio = report_lib.with_spread(
        fit.ms_per_step / t.ms_per_step,
        None if path == "keras_fit" else report_lib.round_ratios(
            fit.rounds_ms, t.rounds_ms))
    report.say(f"{model:<8} {replicas:>8} {path:<18} {t.ms_per_step:>9.2f} "
               f"{t.examples_per_sec:>11,.0f}  {ratio}")
  tfmgpu = best["tfmgpu"]
  report.figure(f"tfmgpu/keras_fit {model} x{replicas}",
                fit.ms_per_step / tfmgpu.ms_per_step,
                spread=report_lib.round_ratios(fit.rounds_ms,
                                               tfmgpu.rounds_ms),
                target=report_lib.Target(1.0 if replicas == 1 else 1.2))
  for floor, what, target, rule in (
      ("floor", "tfmgpu cost / floor", report_lib.Target(1.10, False), ""),
      ("floor_same_kernels", "tfmgpu cost / floor with its kernels", None,
       "(the loop's own cost)")):
    if floor in best:
      report.figure(f"{what} {model} x1",
                    tfmgpu.ms_per_step / best[floor].ms_per_step, rule,
                    report_lib.round_ratios(tfmgpu.rounds_ms,
                                            best[floor].rounds_ms), target)


def _ceiling(report: report_lib.Report, opts: SuiteOptions,
             arrays) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report.header("Compute ceiling: achieved FLOP/s vs float32 matmul")
  kwargs = dict(models=["convnet"] if opts.quick else list(opts.models),
                global_batch_size=opts.global_batch_size, steps=opts.steps,
                steps_per_execution=opts.steps_per_execution,
                batches=[opts.global_batch_size] if opts.quick else None,
                rounds=opts.training_rounds)
  threads = tf.config.threading.get_intra_op_parallelism_threads()
  if threads and threads < devices_lib.cpu_cores():
    report.say(f"  (single-device training gets every core: measured in a "
               f"child process; this one gives each op {threads} thread(s) "
               "so that its logical devices share the cores)")
    result = ceiling_lib.measure_ceiling_in_child(**kwargs)
  else:
    result = ceiling_lib.measure_ceiling(**kwargs, arrays=arrays)
  gflops = result["gflops"]
  report.measured["matmul_gflops"] = gflops
  report.say(f"  float32 matmul ceiling: {gflops:,.1f} GFLOP/s "
             f"({devices_lib.cpu_cores()} cores busy); each model's paths "
             f"built once, best of {opts.training_rounds} interleaved rounds")
  floors = {(r["model"], r["batch"]): r["achieved_gflops"] / gflops
            for r in result["runs"] if r["path"] == "floor"}
  for run in result["runs"]:
    achieved = run["achieved_gflops"]
    report.add(report_lib.Row(
        "ceiling", run["model"], 1, f"{run['path']}_b{run['batch']}",
        run["ms_per_step"], run["examples_per_sec"], f"{achieved:.1f} GFLOP/s"))
    floor = floors.get((run["model"], run["batch"]))
    target = (report_lib.Target(floor, why="the floor's fraction")
              if run["path"] == "tfmgpu" and run["model"] == "convnet"
              and run["batch"] == opts.global_batch_size and floor else None)
    report.figure(f"{run['model']} batch {run['batch']} {run['path']}: "
                  "fraction of ceiling", achieved / gflops,
                  f"({achieved:.1f} of {gflops:.1f} GFLOP/s"
                  + ("; mlp target >= 0.60)" if run["model"] == "mlp"
                     else f"; {target.text()})" if target else ")"),
                  target=target)


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
  report.header("Optimisations, each on/off (mlp, tfmgpu loop; best of "
                f"{opts.rounds} interleaved rounds)")
  report.say("  (baseline: tfmgpu's defaults, fused optimizer and device-"
             "resident data on; 'off:' rows turn one off; speed-up: best "
             "rounds' ratio (lowest-highest of one round))")
  replicas = max(r for r in opts.replicas if r <= 2)
  spe = opts.steps_per_execution
  strategies, runs = _optimisation_runs(spe, replicas)
  timings: dict[str, list[training_lib.Timing]] = {n: [] for n, _, _ in runs}
  for _ in range(opts.rounds):
    for name, strategy, kwargs in runs:
      kwargs = {"steps_per_execution": spe, **kwargs}
      timings[name].append(training_lib.time_tfmgpu(
          strategies[strategy], "mlp", arrays,
          global_batch_size=opts.global_batch_size, steps=opts.steps,
          **kwargs))
  best = {name: training_lib.best_round(t) for name, t in timings.items()}
  base = best[f"baseline (steps_per_execution={spe})"]
  for name, strategy, _ in runs:
    t = best[name]
    n = replicas if strategy == _REPLICATED else 1
    report.add(report_lib.Row("optimisation", "mlp", n, name, t.ms_per_step,
                              t.examples_per_sec, "", t.rounds_ms))
    ref = base if strategy == _REPLICATED else best[
        "one replica: default strategy"]
    speedup = report_lib.with_spread(
        ref.ms_per_step / t.ms_per_step,
        None if t is ref else report_lib.round_ratios(ref.rounds_ms,
                                                      t.rounds_ms))
    report.say(f"  x{n} {name:<34} {t.ms_per_step:8.2f} ms/step "
               f"{t.examples_per_sec:>10,.0f} ex/s  speed-up {speedup}")
  mirrored, default = (best["one replica: mirrored x1"],
                       best["one replica: default strategy"])
  report.figure("one replica: mirrored cost / default strategy cost",
                mirrored.ms_per_step / default.ms_per_step,
                "(> 1 is MirroredStrategy overhead)",
                report_lib.round_ratios(mirrored.rounds_ms, default.rounds_ms))


def _compression_accuracy(report: report_lib.Report,
                          opts: SuiteOptions, arrays) -> None:
  from tfmgpu.training import allreduce  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  report.header("Gradient compression: bytes and accuracy (convnet, x2)")
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
                sent["float16"] / sent["none"],
                target=report_lib.Target(0.5, at_least=False))
  report.figure("accuracy points lost to float16 compression",
                100 * (accuracy["none"] - accuracy["float16"]),
                target=report_lib.Target(0.5, at_least=False))


def _inference(report: report_lib.Report, opts: SuiteOptions,
               arrays) -> None:
  report.header("Inference: tfmgpu.predict vs Keras predict (convnet)")
  x = arrays.x_train
  for replicas in opts.replicas:
    best = inference_lib.compare_predict(_mirrored(replicas), "convnet", x,
                                         rounds=2 if opts.quick else 3)
    for path, t in best.items():
      report.add(report_lib.Row("inference", "convnet", replicas, path,
                                t.ms_per_step, t.examples_per_sec, "",
                                t.rounds_ms))
    tfmgpu, keras = best["tfmgpu"], best["keras_predict"]
    report.say(f"  x{replicas}: tfmgpu {tfmgpu.examples_per_sec:>9,.0f}"
               f" ex/s, keras {keras.examples_per_sec:>9,.0f} ex/s")
    report.figure(f"tfmgpu.predict/keras predict x{replicas}",
                  keras.ms_per_step / tfmgpu.ms_per_step, "",
                  report_lib.round_ratios(keras.rounds_ms, tfmgpu.rounds_ms),
                  report_lib.Target(1.0))
  if not opts.quick:
    _inference_options(report, opts, x)


def _inference_options(report: report_lib.Report, opts: SuiteOptions,
                       x) -> None:
  """tfmgpu.predict's options, each on/off (full runs only)."""
  replicas = max(r for r in opts.replicas if r <= 2)
  strategy = _mirrored(replicas)
  report.say(f"  inference options, x{replicas} (each on/off):")
  for name, options in {
      "batch 1024, steps_per_execution=4 (defaults)": {},
      "steps_per_execution=1": dict(steps_per_execution=1),
      "batch 128": dict(batch_size=128),
      "precision=bfloat16": dict(precision="bfloat16"),
      "prefetch=False (no read-ahead to the devices)": dict(prefetch=False),
  }.items():
    t = inference_lib.time_predictor(strategy, "convnet", x, **options)
    report.add(report_lib.Row("inference_option", "convnet", replicas, name,
                              t.ms_per_step, t.examples_per_sec))
    report.say(f"    {name:<46} {t.examples_per_sec:>9,.0f} ex/s")


def _serving_placements(opts: SuiteOptions, arrays) -> dict[str, tuple]:
  """`{placement: (model to serve, Keras reference)}`: data-parallel models
  built in their strategy's scope, placements split from a one-device model.

  The Keras reference serves a request as a Keras user would: the same
  model's `predict_on_batch` under the same strategy (one device for the
  placements: their unsplit model).
  """
  one = _build("convnet", arrays)
  served = {"one_device": (one, one)}
  for replicas in opts.replicas:
    if replicas > 1:
      with _mirrored(replicas).scope():
        replicated = _build("convnet", arrays)
      served[f"mirrored x{replicas}"] = (replicated, replicated)
  if max(opts.replicas) >= 2:
    for name in ("model_parallel", "pipeline"):
      placed, _ = serving_lib.place_for_serving([one], name, num_stages=2)
      served[f"{name} x2"] = (placed, one)
  return served


def _latency(report: report_lib.Report, opts: SuiteOptions, arrays) -> None:
  report.header("Serving latency: one request of a few rows, per placement "
                "(convnet)")
  report.say("  p50 / p99 ms per request; Keras = predict_on_batch of the "
             "same model and strategy; ex/s = full passes at batch 1024")
  x = arrays.x_train
  calls = 30 if opts.quick else 200
  for name, (model, keras_model) in _serving_placements(opts, arrays).items():
    predictor = serving_lib.Predictor(model)
    throughput = inference_lib.time_predictor_of(predictor, x)
    for rows in (1, 32):
      ours = inference_lib.latency("tfmgpu", predictor.predict, x, rows=rows,
                                   calls=calls)
      try:
        keras = inference_lib.latency("keras", keras_model.predict_on_batch,
                                      x, rows=rows, calls=calls)
        keras_text = f"{keras.p50_ms:6.2f} / {keras.p99_ms:6.2f}"
      except Exception as e:  # pylint: disable=broad-except
        keras, keras_text = None, f"fails ({type(e).__name__})"
      for lat in (ours, keras):
        if lat is not None:
          report.add(report_lib.Row("latency", "convnet", rows,
                                    f"{name} {lat.path}", lat.p50_ms,
                                    rows * 1e3 / lat.p50_ms,
                                    f"p99 {lat.p99_ms:.3f} ms"))
      report.say(f"  {name:<18} {rows:>3} rows  tfmgpu {ours.p50_ms:6.2f} / "
                 f"{ours.p99_ms:6.2f}   keras {keras_text}   "
                 f"{throughput.examples_per_sec:>9,.0f} ex/s")


def _timed_rounds(opts: SuiteOptions, paths: dict[str, Callable[[], Any]]
                  ) -> dict[str, training_lib.Timing]:
  """Each path's best of `opts.rounds` interleaved rounds (all kept)."""
  return training_lib.interleaved(paths, opts.rounds)


def _built_rounds(opts: SuiteOptions,
                  runs: dict[str, Callable[[int], training_lib.Timing]]
                  ) -> dict[str, training_lib.Timing]:
  """Each path (built once: `run(skip)`) timed in `opts.rounds`
  interleaved rounds, best kept; each round's first call left out."""
  return _timed_rounds(opts, {name: functools.partial(run, 1)
                              for name, run in runs.items()})


# The language-model figures with a target (issue 30): tokens/s over Keras
# fit of the unsplit model, and model FLOPs utilisation on one device.
_LM_TARGET_LAYOUTS = ("one_device", "mirrored x2", "mirrored x4")


def _language_model(report: report_lib.Report, opts: SuiteOptions,
                    arrays) -> None:
  del arrays  # Trains on stdlib_text.
  size, seq_len, batch = "mini", 64, opts.global_batch_size
  text = lm_lib.text_arrays(seq_len)
  report.header(f"Language model: gpt {size} (T={seq_len}, batch {batch}) "
                "tokens/s per layout vs Keras fit unsplit")
  common = dict(size=size, global_batch_size=batch,
                steps=4 if opts.quick else 12, steps_per_execution=2)
  alone, child = _lm_one_device(report, opts, seq_len, common)
  layouts = {l.label: l for l in lm_lib.layouts(max(opts.replicas),
                                                quick=opts.quick)
             if l.strategy != "one_device"}
  runs = {"keras_fit": lm_lib.keras_fit_runner(text, **common)}
  runs.update(_lm_runs(report, opts, text, layouts, common))
  # The ceiling is what the cores can do: on shared cores each measurement
  # is low by the load of its moment, so the highest one is kept. --quick
  # after the ceiling section has two (it and the child): none more here.
  ceilings = [child["matmul_gflops"], report.measured.get("matmul_gflops", 0)]
  again = not (opts.quick and ceilings[1])
  ceilings += [ceiling_lib.matmul_gflops()] if again else []
  best = _built_rounds(opts, runs) if layouts else {}
  ceilings += [ceiling_lib.matmul_gflops()] if again else []
  ceiling = max(ceilings)
  flops = lm_lib.flops_per_token(text, size)
  report.say(f"  (each path built once, best of {opts.rounds} interleaved "
             f"rounds; MFU: tokens/s x {flops / 1e6:.2f} MFLOP per token / "
             f"the {ceiling:,.1f} GFLOP/s matmul ceiling, the highest of "
             "this run's measurements)")
  report.say("  one device, in its own process with every core per op (as "
             "a one-device run has them), against Keras fit there:")
  _lm_rows(report, alone, layouts, size, seq_len, flops / ceiling,
           where="own process")
  if best:
    report.say(f"  this process ({max(opts.replicas)} logical CPUs, one "
               "thread per op), against Keras fit on one of them:")
    _lm_rows(report, best, layouts, size, seq_len, flops / ceiling)
  _pipeline_gain(report, opts, text, size, batch)


def _lm_one_device(report: report_lib.Report, opts: SuiteOptions,
                   seq_len: int, common: dict[str, Any]
                   ) -> tuple[dict[str, training_lib.Timing], dict[str, Any]]:
  """Keras fit and tfmgpu's one-device path in a child process (with the
  autotune's choice there: measured, or read from its cache in --quick)."""
  report.say("  one device: measuring in a child process" + (
      " (its autotune, when not cached: a few minutes)" if opts.autotune
      and not opts.quick else "") + " ...")
  alone, child = lm_lib.measure_one_device_in_child(
      seq_len=seq_len, rounds=opts.rounds, autotune=opts.autotune,
      cached_only=opts.quick, **common)
  if child["autotune"]:
    report.say(f"  one_device (own process): {child['autotune']}")
  return alone, child


def _lm_rows(report: report_lib.Report, best: dict[str, training_lib.Timing],
             layouts: dict[str, lm_lib.Layout], size: str, seq_len: int,
             mfu_per_token: float, where: str = "") -> None:
  """Each path's tokens/s of gpt `size`, its ratio to `best["keras_fit"]`
  and its model FLOPs utilisation (`tokens/s x mfu_per_token / 1e9`), with
  the targets; `where` (e.g. "own process") tells its rows in results.csv
  apart."""
  fit = best["keras_fit"]
  for label, t in best.items():
    devices = layouts[label].devices if label in layouts else 1
    tokens = lm_lib.tokens_per_sec(t, seq_len)
    mfu = tokens * mfu_per_token / 1e9
    report.add(report_lib.Row("language_model", f"gpt_{size}", devices,
                              f"{label} ({where})" if where else label,
                              t.ms_per_step, tokens,
                              f"tokens/s; MFU {mfu:.3f}", t.rounds_ms))
    report.say(f"    {label:<22} {tokens:>10,.0f} tokens/s  "
               f"{t.ms_per_step:8.1f} ms/step  x{fit.ms_per_step / t.ms_per_step:.2f}"
               f" of keras fit  MFU {mfu:.3f}")
    if label in _LM_TARGET_LAYOUTS:
      report.figure(f"gpt {size} {label} tokens/s / keras fit",
                    fit.ms_per_step / t.ms_per_step,
                    spread=report_lib.round_ratios(fit.rounds_ms, t.rounds_ms),
                    target=report_lib.Target(1.2))
    if label == "one_device":
      report.figure(f"gpt {size} one_device model FLOPs utilisation", mfu,
                    target=report_lib.Target(0.5))


def _lm_runs(report: report_lib.Report, opts: SuiteOptions, text,
             layouts: dict[str, lm_lib.Layout], common: dict[str, Any]
             ) -> dict[str, Callable[[int], training_lib.Timing]]:
  """tfmgpu's path of each layout; the data-parallel ones with the
  autotune's choice for gpt (XLA per replica, input mode, compression:
  measured, or read from its cache; `--quick` only reads it)."""
  runs = {}
  for label, layout in layouts.items():
    options = {}
    if opts.autotune and layout.strategy == "mirrored":
      choice = lm_lib.tune(layout, text, size=common["size"],
                           global_batch_size=common["global_batch_size"],
                           steps_per_execution=common["steps_per_execution"],
                           rounds=opts.rounds, cached_only=opts.quick)
      options = training_lib.tuned_options(choice.settings)
      report.say(f"  {label}: {choice.describe()}")
    runs[label] = lm_lib.layout_runner(layout, text, **common,
                                       trainer_options=options)
  return runs


def _pipeline_runs(quick: bool) -> list[tuple[str, int, int]]:
  """`(schedule, M, virtual stages)` of the pipeline x2 runs: GPipe (the
  targets), 1F1B and interleaved 1F1B (2 stages per device) at M=4;
  `quick`: the target's GPipe M=4 alone."""
  if quick:
    return [("gpipe", 4, 1)]
  return [("gpipe", 4, 1), ("gpipe", 8, 1), ("1f1b", 4, 1), ("1f1b", 4, 2)]


def _pipeline_gain(report: report_lib.Report, opts: SuiteOptions, text,
                   size: str, batch: int) -> None:
  if max(opts.replicas) < 2:
    return
  report.say("  pipeline x2 (one thread per op): step speed-up over M=1 and "
             "bubble, measured vs simulated from the stages' measured times "
             "(devices alone; calibrated: the devices' measured concurrency "
             "shared by stages that each keep the cores they were measured "
             "to use alone)")
  bound = overlap_lib.measure_concurrency(["/cpu:0", "/cpu:1"])
  report.say(f"    the 2 devices compute at once x{bound:.2f} (2.00: each "
             "its own core; the bound on any pipeline gain here)")
  for schedule, m, virtual in _pipeline_runs(opts.quick):
    run, = lm_lib.pipeline_gain(text, size=size, num_stages=2,
                                micro_batches=(m,), global_batch_size=batch,
                                steps=3 if opts.quick else 8,
                                schedule=schedule, virtual_stages=virtual,
                                concurrency=bound)
    one, many = run.results[1], run.results[m]
    measured, predicted = one.step / many.step, one.predicted / many.predicted
    calibrated = one.calibrated / many.calibrated
    label = f"{schedule} M={m}" + (f" V={virtual}" if virtual > 1 else "")
    report.add(report_lib.Row(
        "pipeline_gain", f"gpt_{size}", 2, label, many.step * 1e3,
        batch / many.step, f"simulated x{predicted:.2f}, calibrated "
        f"x{calibrated:.2f}; step {many.step * 1e3:.1f} ms (calibrated "
        f"{many.calibrated * 1e3:.1f}); bubble {many.measured_bubble:.3f} "
        f"(simulated {many.timeline.bubble_fraction:.3f})"))
    report.say(f"    {label:<18} x{measured:.2f} (simulated x{predicted:.2f},"
               f" calibrated x{calibrated:.2f})  step {many.step * 1e3:.1f} "
               f"ms (calibrated {many.calibrated * 1e3:.1f})  bubble "
               f"{many.measured_bubble:.3f} (simulated "
               f"{many.timeline.bubble_fraction:.3f})  a stage alone keeps "
               f"x{many.stage_cores:.2f} cores busy")
    if schedule == "gpipe":
      report.figure(f"gpt pipeline x2 M={m} / M=1 speed-up", measured,
                    target=report_lib.Target(
                        1 + 0.8 * (calibrated - 1),
                        why=f"80% of the calibrated simulated gain "
                        f"(x{calibrated:.2f}; devices alone x{predicted:.2f})"))
    elif virtual > 1:
      report.figure(f"gpt pipeline x2 interleaved V={virtual} M={m} bubble",
                    many.measured_bubble,
                    f"(simulated {many.timeline.bubble_fraction:.3f})")


def _hybrid(report: report_lib.Report, opts: SuiteOptions, arrays) -> None:
  """gpt tokens/s of each hybrid layout that fits the process's devices,
  against data parallelism on as many, beside the projection for a GPU
  host (`benchmarks.hybrid`, `projection.project_layout`)."""
  del arrays  # Trains on stdlib_text.
  size, overrides = (hybrid_lib.QUICK_MODEL if opts.quick
                     else hybrid_lib.FULL_MODEL)
  seq_len, spe = 64, 2
  report.header(f"Hybrid layouts: gpt {size} tokens/s on logical devices, "
                "beside a projection for an 8-GPU host")
  fit = _hybrid_notes(report, opts, size, overrides, seq_len, spe)
  if not fit:
    return
  big = hybrid_lib.projection_model()
  text = lm_lib.text_arrays(seq_len)
  common = dict(size=size, overrides=overrides,
                global_batch_size=opts.global_batch_size,
                steps=6 if opts.quick else 12, steps_per_execution=spe)
  report.say(f"  {'layout':<37} {'devices':>7} {'tokens/s':>9} "
             f"{'ms/step':>8}  {'vs data':<18}|  {'proj. ms':>8} "
             f"{'vs data':>7} {'GB':>5}")
  for n, layouts in fit.items():
    runs = {hybrid_lib.label(l): hybrid_lib.prepare(l, text, **common)
            for l in layouts}
    _hybrid_rows(report, n, layouts, _timed_rounds(opts, runs), big,
                 size, seq_len)


def _hybrid_notes(report: report_lib.Report, opts: SuiteOptions, size: str,
                  overrides: dict[str, Any], seq_len: int, spe: int
                  ) -> dict[int, tuple]:
  """What the hybrid table measures and projects; the device groups that
  fit this process (the others are named as skipped)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  have = len(devices_lib.accelerator_devices())
  fit, skipped = hybrid_lib.groups(have)
  changed = ", ".join(f"{k}={v}" for k, v in overrides.items())
  threads = tf.config.threading.get_intra_op_parallelism_threads() or "all"
  report.say(
      f"  measured: gpt {size}{f' ({changed})' if changed else ''} (T="
      f"{seq_len}, batch {opts.global_batch_size}, Adam, steps_per_execution="
      f"{spe}) trained by tfmgpu's Trainer, {threads} thread(s) per op; best "
      f"of {opts.rounds} interleaved rounds; vs data: tokens/s over data "
      "parallelism (mirrored) on the group's devices (lowest-highest of one "
      "round)")
  report.say(f"  projected (cost model, not measured): "
             f"{hybrid_lib.projection_words()}; the same layout and batch, "
             "Adam; GB: its fullest device")
  report.say(f"  the {have} logical devices share {devices_lib.cpu_cores()} "
             f"core(s) (load average {os.getloadavg()[0]:.2f} at the start):"
             " no layout gets more compute than they give, so a ratio "
             "compares overheads, not a parallel speed-up")
  for n in skipped:
    report.say(f"  {n}-device layouts skipped: this process has {have} "
               "logical devices (fixed once per process); "
               f"--virtual_devices={n} runs them too")
  return fit


def _hybrid_rows(report: report_lib.Report, n: int, layouts, best, big,
                 size: str, seq_len: int) -> None:
  """One device group's lines of the hybrid table, and its rows."""
  projected = {hybrid_lib.label(l): projection_lib.project_layout(
      big, l, global_batch_size=best[hybrid_lib.label(l)].global_batch_size,
      host=hybrid_lib.PROJECTION_HOST) for l in layouts}
  ref = hybrid_lib.label(hybrid_lib.reference(n))
  for layout in layouts:
    name = hybrid_lib.label(layout)
    t, p = best[name], projected[name]
    speed = best[ref].ms_per_step / t.ms_per_step
    ratio = report_lib.with_spread(speed, None if name == ref else (
        report_lib.round_ratios(best[ref].rounds_ms, t.rounds_ms)))
    p_ratio = projected[ref].step_ms / p.step_ms
    tokens = lm_lib.tokens_per_sec(t, seq_len)
    report.add(report_lib.Row(
        "hybrid", f"gpt_{size}", layout.num_devices, name, t.ms_per_step,
        tokens, f"of {n} devices; vs data {n} x{speed:.3f}; projected "
        f"{p.host} {p.step_ms:.2f} ms/step (x{p_ratio:.2f})", t.rounds_ms))
    over = "" if p.fits else " over"
    report.say(f"  {name:<37} {layout.num_devices:>3} of {n} {tokens:>9,.0f} "
               f"{t.ms_per_step:>8.1f}  {ratio:<18}|  {p.step_ms:>8.2f} "
               f"{p_ratio:>7.2f} {p.peak_bytes / 1e9:>5.1f}{over}")


def _projection(report: report_lib.Report, opts: SuiteOptions,
                arrays) -> None:
  report.header("Projection (not a measurement): data parallel on N GPUs")
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


def _checkpoint_cost(report: report_lib.Report, opts: SuiteOptions,
                     arrays) -> None:
  """What saving a checkpoint every call costs (`checkpoint_every_steps`)."""
  replicas = max(r for r in opts.replicas if r <= 2)
  spe = opts.steps_per_execution
  report.header(f"Checkpoint cost: a save every {spe} steps (mlp, "
                f"{replicas} replicas, tfmgpu loop)")
  strategy = _mirrored(replicas)
  common = dict(global_batch_size=opts.global_batch_size, steps=opts.steps,
                steps_per_execution=spe)
  base = training_lib.time_tfmgpu(strategy, "mlp", arrays, **common)
  with tempfile.TemporaryDirectory() as model_dir:
    saving = training_lib.time_tfmgpu(strategy, "mlp", arrays,
                                      model_dir=model_dir,
                                      checkpoint_every_steps=spe, **common)
  per_save = (saving.ms_per_step - base.ms_per_step) * spe
  report.say(f"  {base.ms_per_step:.2f} ms/step without saving, "
             f"{saving.ms_per_step:.2f} ms/step with: {per_save:.1f} ms per "
             "save (fsynced files, state file written aside)")
  report.add(report_lib.Row("checkpoints", "mlp", replicas, "no_saves",
                            base.ms_per_step, base.examples_per_sec))
  report.add(report_lib.Row("checkpoints", "mlp", replicas,
                            f"save_every_{spe}_steps", saving.ms_per_step,
                            saving.examples_per_sec))
  report.figure("checkpoint save, ms per save", per_save, "(measured)")


def _tf_data(report: report_lib.Report, opts: SuiteOptions, arrays) -> None:
  report.header("Shuffled tf.data input: tfmgpu vs fit vs TF Orbit "
                "StandardTrainer (examples/s, best round)")
  if not orbit_lib.orbit_installed():
    report.say(f"  Orbit {orbit_lib.ORBIT_MISSING}: its column is empty")
  models = ([m for m in opts.models if m == "convnet"] or opts.models[:1]
            if opts.quick else opts.models)
  for model_name in models:
    for replicas in opts.replicas:
      row = orbit_lib.compare(
          model_name, arrays, replicas=replicas,
          global_batch_size=max(opts.global_batch_size, 64),
          steps=opts.steps // 2 if opts.quick else opts.steps,
          steps_per_execution=opts.steps_per_execution,
          # Paths built once, as in the training table: a round costs only
          # its steps, so a full run keeps as many rounds.
          rounds=opts.rounds if opts.quick else opts.training_rounds,
          tf_iterator=not opts.quick)
      for path in ("tfmgpu", "keras_fit", "orbit", "tfmgpu_tf_iterator"):
        rate = getattr(row, path)
        if rate:
          report.add(report_lib.Row("tf_data", model_name, replicas, path,
                                    0.0, rate))
      cells = "".join(
          f"  {label} {rate:>9,.0f}" if rate else f"  {label} {'-':>9}"
          for label, rate in (("orbit", row.orbit),
                              ("tfmgpu on TF's iterator",
                               row.tfmgpu_tf_iterator)))
      report.say(f"  {model_name:<8} x{replicas}: tfmgpu {row.tfmgpu:>9,.0f}  "
                 f"fit {row.keras_fit:>9,.0f}{cells}")
      report.figure(f"tf.data tfmgpu/fit {model_name} x{replicas}",
                    row.vs_fit, target=report_lib.Target(1.0))
      if row.vs_orbit:
        report.figure(f"tf.data tfmgpu/orbit {model_name} x{replicas}",
                      row.vs_orbit, target=report_lib.Target(1.0))
      if row.host_split_gain:
        report.figure(f"tf.data host split/TF's iterator {model_name} "
                      f"x{replicas}", row.host_split_gain, "(measured)")


Section = Callable[[report_lib.Report, "SuiteOptions", Any], None]

SECTIONS: dict[str, Section] = {
    "training": _training,
    "ceiling": _ceiling,
    "optimisations": _optimisations,
    "compression": _compression_accuracy,
    "inference": _inference,
    "latency": _latency,
    "language_model": _language_model,
    "hybrid": _hybrid,
    "tf_data": _tf_data,
    "checkpoints": _checkpoint_cost,
    "projection": _projection,
    "generate": generation_lib.section,
    "zero": zero_lib.section,
}
