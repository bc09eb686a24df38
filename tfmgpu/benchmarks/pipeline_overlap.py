"""Pipeline overlap: one K-stage split with M micro-batches against M=1.

For each M, `compare_micro_batches` times, interleaved in one process, the
training step, the optimizer update alone and a forward-only pass, and
samples each stage alone with a `benchmarks.pipeline.StageProbe`. From those it
derives each stage's busy time per step (M times its forward plus
backward), the measured bubble `1 - sum(busy) / (K * (step - update))`,
and the simulator's step time (simulated pipeline plus the measured
update). `print_report` prints them beside the theoretical bubble
`(K - 1) / (M + K - 1)` and draws the simulated timelines.
`benchmark_deep_mlp` runs it on the demo deep MLP
(`scripts/bench_pipeline.py` is its command line).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu.benchmarks import pipeline as probes
from tfmgpu.models import demo
from tfmgpu.parallel import calibration
from tfmgpu.parallel import partition
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import schedule as schedule_lib
from tfmgpu.parallel import timeline as timeline_lib


@dataclasses.dataclass(frozen=True)
class Overlap:
  """One micro-batch setting, measured and simulated (seconds).

  Attributes:
    step: median training step, optimizer update included.
    fastest: fastest training step.
    fwd, bwd: each stage's forward and backward on one micro-batch, alone.
    busy: each device's busy time per step, `M * (fwd + bwd)` summed
      over its stages (one stage per device unless interleaved).
    update: median optimizer update alone.
    timeline: the simulated pipeline from `fwd` and `bwd`.
    predicted: simulated step time plus `update`.
    infer: median forward-only pass over the batch.
    infer_predicted: the simulated forward-only pass.
    measured_bubble: `1 - sum(busy) / (K * (step - update))` over the `K`
      devices (compare `timeline.bubble_fraction`, the simulated one).
    calibrated: the simulated step with the devices sharing the measured
      concurrency (`timeline.simulate(concurrency=)`) plus `update`;
      `None` when none was given. The concurrency is counted in stages:
      divided by `stage_cores`, as a stage that keeps 1.4 cores busy
      alone gets only 2 / 2.8 of its speed beside another on 2 cores.
    stage_cores: the cores a stage keeps busy while timed alone (median
      of the probe's samples; at least 1).
  """
  step: float
  fastest: float
  fwd: list[float]
  bwd: list[float]
  busy: list[float]
  update: float
  timeline: timeline_lib.Timeline
  predicted: float
  infer: float
  infer_predicted: float
  measured_bubble: float
  calibrated: float | None = None
  stage_cores: float = 1.0


@dataclasses.dataclass(frozen=True)
class OverlapRun:
  """`compare_micro_batches`' results for M=1 and M=`micro_batches`."""
  plan: plan_lib.StagePlan
  num_stages: int
  micro_batches: int
  schedule: str
  results: dict[int, Overlap]
  virtual_stages: int = 1
  send_s: float = 0.0  # One cross-device send at M, charged by the timeline.


def _train_step(pipe, optimizer, loss_fn):

  @tf.function
  def step(x, y):
    loss, _, grads = pipe.compute_loss_and_gradients(x, y, loss_fn)
    optimizer.apply_gradients(zip(grads, pipe.trainable_variables))
    return loss

  return step


def _update_fn(pipe, optimizer):
  """The optimizer update alone, applying zero gradients."""
  zeros = []
  for v in pipe.trainable_variables:
    with tf.device(v.value.device):
      zeros.append(tf.zeros(v.shape, v.dtype))

  @tf.function
  def update():
    optimizer.apply_gradients(zip(zeros, pipe.trainable_variables))
    return optimizer.iterations

  return update


def _setting(model, plan, m: int, schedule: str, x, y, loss_fn,
             virtual_stages: int = 1) -> dict[str, Any]:
  """The pipelined model with `m` micro-batches and its timed functions."""
  pipe = pipeline.PipelinedModel(model, plan, micro_batches=m,
                                 schedule=schedule,
                                 virtual_stages=virtual_stages)
  optimizer = pipe.build_optimizer(keras.optimizers.SGD(1e-4))
  return dict(
      pipe=pipe, optimizer=optimizer,
      step=_train_step(pipe, optimizer, loss_fn),
      update=_update_fn(pipe, optimizer),
      infer=tf.function(lambda xb, pipe=pipe: pipe(xb, training=False)),
      probe=probes.StageProbe(pipe, x.numpy(), y.numpy(), loss_fn,
                              micro_batches=m),
      times=[], updates=[], samples=[], infers=[])


def _seconds(fn, *args) -> float:
  start = time.perf_counter()
  fn(*args).numpy()
  return time.perf_counter() - start


def _time_interleaved(settings: Sequence[dict[str, Any]], x, y, *,
                      steps: int, warmup: int) -> None:
  """Warms up, then times every setting once per round, `steps` rounds."""
  for s in settings:
    for _ in range(warmup + 1):  # The first call traces.
      s["step"](x, y).numpy()
      s["update"]().numpy()
      s["infer"](x).numpy()
  # Interleaved rounds: a change of machine load hits every quantity alike.
  for _ in range(steps):
    for s in settings:
      s["times"].append(_seconds(s["step"], x, y))
      s["updates"].append(_seconds(s["update"]))
      s["infers"].append(_seconds(s["infer"], x))
      s["samples"].append(s["probe"].sample())


# The probes live with the calibration that feeds them to the cost model.
measure_concurrency = calibration.measure_concurrency
measure_send_s = calibration.measure_send_s


def _summarise(s: dict[str, Any], m: int, num_stages: int,
               schedule: str, virtual_stages: int = 1,
               send: float = 0.0, concurrency: float | None = None
               ) -> Overlap:
  """`num_stages`: the devices (`K`); the plan has `K * virtual_stages`;
  `send`: seconds each cross-device send costs its sender; `concurrency`:
  the devices' measured concurrency, for the calibrated step."""
  fwd, bwd = probes.stage_times(s["samples"])
  cores = max(1.0, statistics.median(s["probe"].core_use))
  update = statistics.median(s["updates"])
  simulate = lambda c: timeline_lib.simulate(
      fwd, bwd, m, schedule=schedule, virtual_stages=virtual_stages,
      send_time=send, concurrency=c)
  timeline = simulate(None)
  step = statistics.median(s["times"])
  busy = [0.0] * num_stages
  for k, (f, b) in enumerate(zip(fwd, bwd)):
    busy[k % num_stages] += m * (f + b)
  return Overlap(
      step=step, fastest=min(s["times"]), fwd=fwd, bwd=bwd, busy=busy,
      update=update, timeline=timeline,
      predicted=timeline.step_time + update,
      infer=statistics.median(s["infers"]),
      infer_predicted=timeline_lib.simulate(
          fwd, [0.0] * len(fwd), m, schedule="gpipe").step_time,
      measured_bubble=1.0 - sum(busy) / (num_stages
                                         * max(step - update, 1e-9)),
      calibrated=(None if concurrency is None
                  else simulate(concurrency / cores).step_time + update),
      stage_cores=cores)


def compare_micro_batches(model: keras.Model, plan: plan_lib.StagePlan, x, y,
                          loss_fn, *, micro_batches: int,
                          schedule: str = "gpipe", steps: int = 10,
                          warmup: int = 3, virtual_stages: int = 1,
                          concurrency: float | None = None) -> OverlapRun:
  """Times `plan`'s pipeline with M=1 and M=`micro_batches`, interleaved.

  Args:
    model: the unsplit model that `plan` splits.
    plan: the stage plan (its stages' devices run at once).
    x, y: one batch, as tensors.
    loss_fn: `loss_fn(y_true, y_pred)`, as for `compute_loss_and_gradients`.
    micro_batches: M, compared with M=1.
    schedule: `"gpipe"` or `"1f1b"`. Defaults to `"gpipe"`.
    steps: timed rounds. Defaults to 10.
    warmup: untimed rounds first. Defaults to 3.
    virtual_stages: `V`: `plan`'s stages repeat its first `K` devices and
      M=`micro_batches` runs interleaved 1F1B (M=1 runs the stages in
      order, `"1f1b"`). Defaults to 1.
    concurrency: the devices' measured concurrency
      (`calibration.measure_concurrency`): each `Overlap.calibrated`
      simulates them sharing it. Defaults to `None` (not simulated).

  Returns:
    An `OverlapRun` with one `Overlap` per M.
  """
  num_stages = len(plan.stages) // virtual_stages
  virtual = {m: virtual_stages if m == micro_batches else 1
             for m in sorted({1, micro_batches})}
  settings = {m: _setting(model, plan, m, schedule, x, y, loss_fn, v)
              for m, v in virtual.items()}
  _time_interleaved(list(settings.values()), x, y, steps=steps,
                    warmup=warmup)
  rows = int(tf.nest.flatten(x)[0].shape[0])
  cut = max((st.sent_bytes for st in plan.stages), default=0)
  send = {m: measure_send_s(plan.stages[0].device, plan.stages[1].device,
                            cut * rows // m)
          if len(plan.stages) > 1 else 0.0 for m in settings}
  return OverlapRun(plan, num_stages, micro_batches, schedule, {
      m: _summarise(s, m, num_stages, schedule, virtual[m], send[m],
                    concurrency)
      for m, s in settings.items()}, virtual_stages, send[micro_batches])


def benchmark_deep_mlp(devices: Sequence[str], *, width: int = 1024,
                       depth: int = 8, batch_size: int = 1024,
                       micro_batches: int = 4, schedule: str = "gpipe",
                       steps: int = 10, warmup: int = 3) -> OverlapRun:
  """`compare_micro_batches` on the demo deep MLP over `devices`, one stage
  per device, on random data (seed 0).

  Raises:
    ValueError: `micro_batches` does not divide `batch_size`.
  """
  if batch_size % micro_batches:
    raise ValueError(f"batch_size={batch_size} is not divisible by "
                     f"micro_batches={micro_batches}; use a multiple of "
                     f"{micro_batches}.")
  keras.utils.set_random_seed(0)
  model = demo.deep_mlp((width,), 10, depth=depth, width=width)
  plan = partition.plan_stages(model, len(devices), devices=devices)
  rng = np.random.RandomState(0)
  x = tf.constant(rng.randn(batch_size, width).astype("float32"))
  y = tf.constant(rng.randint(0, 10, size=(batch_size,)))

  def loss_fn(y_true, y_pred):
    return tf.nn.compute_average_loss(
        keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True), global_batch_size=batch_size)

  return compare_micro_batches(model, plan, x, y, loss_fn,
                               micro_batches=micro_batches, schedule=schedule,
                               steps=steps, warmup=warmup)


def _ms(t: float) -> str:
  return f"{1e3 * t:.1f}"


def _error(predicted: float, measured: float) -> str:
  return f"{100 * (predicted - measured) / measured:+.1f}%"


def _print_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
                 out: Callable[[str], None]) -> None:
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  for cells in (header, *rows):
    out("  ".join(str(c).rjust(w) for c, w in zip(cells, widths)))


def _print_training(run: OverlapRun, out: Callable[[str], None]) -> None:
  header = ("M", "step ms", "min ms", "predicted ms", "pred err",
            "fwd ms/stage", "bwd ms/stage", "busy ms/stage", "update ms",
            "bubble meas", "bubble sim", "bubble theory")
  _print_table(header, [(
      m, _ms(r.step), _ms(r.fastest), _ms(r.predicted),
      _error(r.predicted, r.step), "/".join(_ms(t) for t in r.fwd),
      "/".join(_ms(t) for t in r.bwd), "/".join(_ms(t) for t in r.busy),
      _ms(r.update), f"{r.measured_bubble:.3f}",
      f"{r.timeline.bubble_fraction:.3f}",
      f"{schedule_lib.theoretical_bubble(run.num_stages, m):.3f}")
                       for m, r in run.results.items()], out)
  M, one = run.micro_batches, run.results[1]
  out(f"(simulated with each cross-device send charged "
      f"{1e3 * run.send_s:.3f} ms to its sender, measured)")
  if M != 1:
    ratio = one.step / run.results[M].step
    out(f"\nTraining: M={M} vs M=1: {ratio:.2f}x faster per step "
        f"({'overlap shown' if ratio > 1 else 'NO speed-up'}); the "
        f"simulator predicts "
        f"{one.predicted / run.results[M].predicted:.2f}x.")


def _print_inference(run: OverlapRun, out: Callable[[str], None]) -> None:
  out("\nInference (forward only, no intra-stage parallel work):")
  _print_table(("M", "predict ms", "predicted ms", "pred err"), [
      (m, _ms(r.infer), _ms(r.infer_predicted),
       _error(r.infer_predicted, r.infer)) for m, r in run.results.items()],
               out)
  M, one = run.micro_batches, run.results[1]
  if M != 1:
    out(f"Inference: M={M} vs M=1: "
        f"{one.infer / run.results[M].infer:.2f}x faster; the "
        f"simulator predicts "
        f"{one.infer_predicted / run.results[M].infer_predicted:.2f}x.")


def print_report(run: OverlapRun, *, png_prefix: str | None = None,
                 out: Callable[[str], None] = print) -> None:
  """Prints the plan, both tables and the simulated timelines (in ms).

  Args:
    run: what `compare_micro_batches` returned.
    png_prefix: also draw each timeline to `<png_prefix>_m<M>.png` (needs
      matplotlib; without it, says so).
    out: where each line goes. Defaults to `print`.
  """
  out(run.plan.table())
  _print_training(run, out)
  _print_inference(run, out)
  out("\n'step' includes the optimizer update; 'predicted' = simulated "
      "pipeline + measured update; measured bubble uses busy = M * (fwd + "
      "bwd) measured per stage alone, against step - update.")
  for m, r in run.results.items():
    out(f"\nSimulated timeline, M={m} (ms):")
    scaled = timeline_lib.Timeline(
        r.timeline.num_stages, m, r.timeline.schedule,
        tuple(timeline_lib.Event(e.task, 1e3 * e.start, 1e3 * e.end)
              for e in r.timeline.events))
    out(scaled.text(width=72))
    if png_prefix:
      try:
        out(f"wrote {scaled.plot(f'{png_prefix}_m{m}.png')}")
      except ImportError as e:
        out(f"(no PNG: {e})")
