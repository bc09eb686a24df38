r"""Benchmarks pipeline overlap: one K-stage split with M micro-batches vs 1.

TensorFlow runs each op on one thread (`--intra_op=1`) and up to
`--inter_op` ops at once, with one logical CPU per stage on a 2-core machine:
two stages go faster together only if their ops really run at the same time.
(TF's oneDNN kernels hand an op's work to the intra-op pool and wait, so with
one intra-op thread, ops of different stages would queue on that one thread;
the script sets TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD=1, unless set, so each
op runs on its own inter-op thread.) For M=1 and M=--micro_batches it prints:

* the median step time (interleaved runs, same process) and the speed-up;
* each stage's forward/backward time on one micro-batch, measured alone, and
  its busy time per step (M times their sum);
* the measured bubble `1 - sum(busy) / (K * step)` next to the theoretical
  `(K - 1) / (M + K - 1)` and the simulator's;
* the simulator's predicted step time (from the measured stage times, plus
  the measured optimizer update) against the measured one;
* the simulated timelines as ASCII Gantt charts (and a PNG with --png).

  python scripts/bench_pipeline.py                      # K=2, M=4 vs 1
  python scripts/bench_pipeline.py --micro_batches=8 --schedule=1f1b

Unlike a GPU, a CPU stage is not one in-order stream: with 2 inter-op
threads a stage alone already runs each layer's two backward matmuls (weight
and input gradients) at once, so M=1 is not fully serial and the gain from
pipelining is smaller than the bubble alone suggests. Micro-batches must stay
large enough (>= 256 rows here) for their matmuls to be as efficient as the
whole batch's; hence the default batch of 1024.

On a shared 2-core machine, other processes steal cycles: check `uptime` and
run it when the machine is quiet.
"""

import os
import pathlib
import statistics
import sys
import time

from absl import app
from absl import flags

# Run from a checkout: make `tfmgpu` importable without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_WIDTH = flags.DEFINE_integer("width", 1024, "Units per hidden layer (and "
                              "input features).", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 8, "Hidden layers.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 1024, "Examples per step.",
                              lower_bound=1)
_STAGES = flags.DEFINE_integer("num_stages", 2, "Pipeline stages (K).",
                               lower_bound=1)
_MICRO = flags.DEFINE_integer("micro_batches", 4, "Micro-batches (M), "
                              "compared with M=1.", lower_bound=1)
_SCHEDULE = flags.DEFINE_enum("schedule", "gpipe", ["gpipe", "1f1b"],
                              "Pipeline schedule.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per setting.",
                              lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps first.",
                               lower_bound=0)
_INTRA = flags.DEFINE_integer("intra_op", 1, "Threads per op.", lower_bound=1)
_INTER = flags.DEFINE_integer("inter_op", 2, "Ops run at once (>= 2 to let "
                              "stages overlap).", lower_bound=1)
_PNG = flags.DEFINE_string("png", None, "Also draw the simulated timelines "
                           "to this PNG prefix (needs matplotlib).")


def _configure():
  """Threading and logical devices: before TensorFlow initialises."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # TF's oneDNN kernels (the default on x86) hand each op's work to the
  # intra-op pool and wait; with one intra-op thread, ops on different
  # logical CPUs then queue on that one thread and never overlap. Running the
  # work on the calling (inter-op) thread instead lets them overlap.
  os.environ.setdefault("TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD", "1")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfmgpu  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(_INTRA.value)
  tf.config.threading.set_inter_op_parallelism_threads(_INTER.value)
  tfmgpu.configure_devices(logical_cpus=_STAGES.value)
  return tfmgpu.list_devices("CPU")[:_STAGES.value]


def _train_step(pipe, optimizer, loss_fn):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function
  def step(x, y):
    loss, _, grads = pipe.compute_loss_and_gradients(x, y, loss_fn)
    optimizer.apply_gradients(zip(grads, pipe.trainable_variables))
    return loss

  return step


def _update_fn(pipe, optimizer):
  """The optimizer update alone, applying zero gradients."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  zeros = []
  for v in pipe.trainable_variables:
    with tf.device(v.value.device):
      zeros.append(tf.zeros(v.shape, v.dtype))

  @tf.function
  def update():
    optimizer.apply_gradients(zip(zeros, pipe.trainable_variables))
    return optimizer.iterations

  return update


def _row(cells, widths):
  return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def main(argv):
  del argv
  devices = _configure()
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import demo_models  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import schedule as schedule_lib  # pylint: disable=g-import-not-at-top

  K, M, batch = _STAGES.value, _MICRO.value, _BATCH.value
  if batch % M:
    raise app.UsageError(f"--batch_size={batch} is not divisible by "
                         f"--micro_batches={M}; use a multiple of {M}.")
  keras.utils.set_random_seed(0)
  width = _WIDTH.value
  model = demo_models.deep_mlp((width,), 10, depth=_DEPTH.value, width=width)
  plan = partition.plan_stages(model, K, devices=devices)
  rng = np.random.RandomState(0)
  x = tf.constant(rng.randn(batch, width).astype("float32"))
  y = tf.constant(rng.randint(0, 10, size=(batch,)))

  def loss_fn(y_true, y_pred):
    return tf.nn.compute_average_loss(
        keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True), global_batch_size=batch)

  settings = {}
  for m in sorted({1, M}):
    pipe = pipeline.PipelinedModel(model, plan, micro_batches=m,
                                   schedule=_SCHEDULE.value)
    optimizer = pipe.build_optimizer(keras.optimizers.SGD(1e-4))
    settings[m] = dict(
        pipe=pipe, optimizer=optimizer,
        step=_train_step(pipe, optimizer, loss_fn),
        update=_update_fn(pipe, optimizer),
        infer=tf.function(lambda xb, pipe=pipe: pipe(xb, training=False)),
        probe=pipeline.StageProbe(pipe, x.numpy(), y.numpy(), loss_fn,
                                  micro_batches=m),
        times=[], updates=[], samples=[], infers=[])
  for s in settings.values():
    for _ in range(_WARMUP.value + 1):  # The first call traces.
      s["step"](x, y).numpy()
      s["update"]().numpy()
      s["infer"](x).numpy()
  # Interleaved rounds: a change of machine load hits every quantity alike.
  for _ in range(_STEPS.value):
    for s in settings.values():
      start = time.perf_counter()
      s["step"](x, y).numpy()
      s["times"].append(time.perf_counter() - start)
      start = time.perf_counter()
      s["update"]().numpy()
      s["updates"].append(time.perf_counter() - start)
      start = time.perf_counter()
      s["infer"](x).numpy()
      s["infers"].append(time.perf_counter() - start)
      s["samples"].append(s["probe"].sample())

  results = {}
  for m, s in settings.items():
    fwd, bwd = pipeline.stage_times(s["samples"])
    update = statistics.median(s["updates"])
    timeline = schedule_lib.simulate(fwd, bwd, m, schedule=_SCHEDULE.value)
    step = statistics.median(s["times"])
    busy = [m * (f + b) for f, b in zip(fwd, bwd)]
    results[m] = dict(
        step=step, fastest=min(s["times"]), fwd=fwd, bwd=bwd, busy=busy,
        update=update, timeline=timeline,
        predicted=timeline.step_time + update,
        infer=statistics.median(s["infers"]),
        infer_predicted=schedule_lib.simulate(
            fwd, [0.0] * K, m, schedule=_SCHEDULE.value).step_time,
        measured_bubble=1.0 - sum(busy) / (K * max(step - update, 1e-9)))

  ms = lambda t: f"{1e3 * t:.1f}"
  print(f"\nPipeline benchmark: deep_mlp width={width} depth={_DEPTH.value}, "
        f"batch {batch}, K={K} stages on {', '.join(devices)}, "
        f"schedule={_SCHEDULE.value}, intra_op={_INTRA.value}, "
        f"inter_op={_INTER.value}, TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD="
        f"{os.environ['TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD']}, "
        f"{_STEPS.value} interleaved steps "
        f"(median), load average {os.getloadavg()[0]:.2f}")
  print(plan.table())
  header = ("M", "step ms", "min ms", "predicted ms", "pred err",
            "fwd ms/stage",
            "bwd ms/stage", "busy ms/stage", "update ms", "bubble meas",
            "bubble sim", "bubble theory")
  rows = []
  for m, r in results.items():
    rows.append((
        m, ms(r["step"]), ms(r["fastest"]), ms(r["predicted"]),
        f"{100 * (r['predicted'] - r['step']) / r['step']:+.1f}%",
        "/".join(ms(t) for t in r["fwd"]), "/".join(ms(t) for t in r["bwd"]),
        "/".join(ms(t) for t in r["busy"]), ms(r["update"]),
        f"{r['measured_bubble']:.3f}", f"{r['timeline'].bubble_fraction:.3f}",
        f"{schedule_lib.theoretical_bubble(K, m):.3f}"))
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  print(_row(header, widths))
  for r in rows:
    print(_row(r, widths))
  if M != 1:
    ratio = results[1]["step"] / results[M]["step"]
    print(f"\nTraining: M={M} vs M=1: {ratio:.2f}x faster per step "
          f"({'overlap shown' if ratio > 1 else 'NO speed-up'}); the "
          f"simulator predicts "
          f"{results[1]['predicted'] / results[M]['predicted']:.2f}x.")
  print("\nInference (forward only, no intra-stage parallel work):")
  header = ("M", "predict ms", "predicted ms", "pred err")
  rows = [(m, ms(r["infer"]), ms(r["infer_predicted"]),
           f"{100 * (r['infer_predicted'] - r['infer']) / r['infer']:+.1f}%")
          for m, r in results.items()]
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  print(_row(header, widths))
  for r in rows:
    print(_row(r, widths))
  if M != 1:
    print(f"Inference: M={M} vs M=1: "
          f"{results[1]['infer'] / results[M]['infer']:.2f}x faster; the "
          f"simulator predicts "
          f"{results[1]['infer_predicted'] / results[M]['infer_predicted']:.2f}"
          "x.")
  print("\n'step' includes the optimizer update; 'predicted' = simulated "
        "pipeline + measured update; measured bubble uses busy = M * (fwd + "
        "bwd) measured per stage alone, against step - update.")
  for m, r in results.items():
    print(f"\nSimulated timeline, M={m} (ms):")
    scaled = schedule_lib.Timeline(
        r["timeline"].num_stages, m, r["timeline"].schedule,
        tuple(schedule_lib.Event(e.task, 1e3 * e.start, 1e3 * e.end)
              for e in r["timeline"].events))
    print(scaled.text(width=72))
    if _PNG.value:
      try:
        print("wrote", scaled.plot(f"{_PNG.value}_m{m}.png"))
      except ImportError as e:
        print(f"(no PNG: {e})")


if __name__ == "__main__":
  app.run(main)
