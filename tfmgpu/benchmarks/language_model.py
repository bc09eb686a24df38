"""Tokens per second of the `gpt` language model under each placement.

Every layout trains the same `gpt` (same size, seed and initial weights) on
the same `stdlib_text` windows with the same global batch, in one process,
timed per step call after a warm-up (tracing excluded), next to Keras
`fit` of the unsplit model on one device. `pipeline_gain` times one
pipeline split with M = 1 and M micro-batches, interleaved, beside the
simulator's prediction from the stages' measured times
(`benchmarks.pipeline_overlap`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu.benchmarks import ceiling
from tfmgpu.benchmarks import child
from tfmgpu.benchmarks import pipeline_overlap
from tfmgpu.benchmarks import training as training_lib
from tfmgpu.parallel import partition
from tfmgpu.training.loop import Trainer


@dataclasses.dataclass(frozen=True)
class Layout:
  """One way to train: a registered strategy or placement and its options."""
  label: str
  strategy: str
  options: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def devices(self) -> int:
    """Devices it needs."""
    return int(self.options.get("num_replicas",
                                self.options.get("num_stages", 1)))


def layouts(max_devices: int, quick: bool = False) -> list[Layout]:
  """The layouts that fit on `max_devices` devices (`quick`: one device and
  data parallelism only, the layouts with targets)."""
  candidates = [Layout("one_device", "one_device")]
  for r in (2, 4):
    candidates.append(Layout(f"mirrored x{r}", "mirrored",
                             {"num_replicas": r}))
  if quick:
    return [c for c in candidates if c.devices <= max_devices]
  candidates.append(Layout("model_parallel x2", "model_parallel",
                           {"num_stages": 2}))
  for k, m, schedule in ((2, 4, "gpipe"), (2, 4, "1f1b"), (4, 8, "gpipe")):
    candidates.append(Layout(
        f"pipeline x{k} M={m} {schedule}", "pipeline",
        {"num_stages": k, "micro_batches": m, "schedule": schedule}))
  return [c for c in candidates if c.devices <= max_devices]


def _build(arrays: data_lib.Arrays, size: str, seed: int,
           **overrides: Any) -> keras.Model:
  return models_lib.build_model("gpt", input_shape=arrays.input_shape,
                                num_classes=arrays.num_classes, seed=seed,
                                size=size, **overrides)


def layout_runner(layout: Layout, arrays: data_lib.Arrays, *, size: str,
                  global_batch_size: int, steps: int,
                  steps_per_execution: int, seed: int = 0,
                  overrides: dict[str, Any] | None = None,
                  trainer_options: dict[str, Any] | None = None
                  ) -> Callable[[int], training_lib.Timing]:
  """Places `gpt` as `layout` says and makes its `Trainer`.

  Args:
    layout: a registered strategy or placement and its options.
    arrays: the `stdlib_text` windows (`text_arrays`).
    size, overrides: the `gpt` size and its overrides (e.g. `num_heads`).
    global_batch_size: examples per step over all replicas.
    steps: steps per `fit` (rounded to whole calls, at least 3).
    steps_per_execution: steps per call.
    seed: the model's and the data order's seed.
    trainer_options: other `Trainer` arguments (e.g. the autotune's
      `jit_compile`).

  Returns:
    `run(skip)`: trains one `fit` of `steps` and returns its `Timing`, the
    median step of its calls after the first `skip` (1 for the fit that
    traces the step; later fits of the same length reuse it). Its
    `trainer` attribute is the `Trainer` it fits with.
  """
  distribution = strategies_lib.lookup(layout.strategy)
  placement = distribution.place(
      distribution.options(**layout.options),
      lambda: _build(arrays, size, seed, **(overrides or {})), seed=seed)
  timer = training_lib.BatchTimer()
  trainer = Trainer(placement.model, strategy=placement.strategy,
                    steps_per_execution=steps_per_execution, verbose=0,
                    callbacks=[timer], **(trainer_options or {}))
  per_epoch = max(steps // steps_per_execution, 3) * steps_per_execution

  def run(skip: int) -> training_lib.Timing:
    timer.times.clear()
    trainer.fit(arrays.x_train, arrays.y_train, epochs=1,
                global_batch_size=global_batch_size,
                steps_per_epoch=per_epoch, seed=seed)
    return training_lib.Timing(
        layout.label, training_lib.median_step_ms(
            timer.times, steps_per_execution, skip), global_batch_size)

  run.trainer = trainer
  return run


def time_layout(layout: Layout, arrays: data_lib.Arrays, *, size: str,
                global_batch_size: int, steps: int,
                steps_per_execution: int, seed: int = 0
                ) -> training_lib.Timing:
  """Median ms per step of tfmgpu's `Trainer` under `layout`."""
  return layout_runner(layout, arrays, size=size,
                       global_batch_size=global_batch_size, steps=steps,
                       steps_per_execution=steps_per_execution,
                       seed=seed)(1)


def time_keras_fit(arrays: data_lib.Arrays, *, size: str,
                   global_batch_size: int, steps: int,
                   steps_per_execution: int, seed: int = 0
                   ) -> training_lib.Timing:
  """Median ms per step of Keras `fit` on the unsplit model, one device."""
  return keras_fit_runner(arrays, size=size,
                          global_batch_size=global_batch_size, steps=steps,
                          steps_per_execution=steps_per_execution,
                          seed=seed)(1)


def tune(layout: Layout, arrays: data_lib.Arrays, *, size: str,
         global_batch_size: int, steps_per_execution: int, rounds: int,
         cached_only: bool, seed: int = 0) -> Any:
  """The autotune's choice (`tfmgpu.training.autotune.tune_training`) for
  a data-parallel `layout` of `gpt` (`one_device`, `mirrored`): input
  mode, XLA per replica and gradient compression, measured; the steps per
  call kept at `steps_per_execution`, what the other paths use."""
  from tfmgpu.training import autotune  # pylint: disable=g-import-not-at-top
  strategy = strategies_lib.get_strategy(layout.strategy, **layout.options)
  return autotune.tune_training(
      lambda: _build(arrays, size, seed), strategy, arrays.x_train,
      arrays.y_train, global_batch_size=global_batch_size,
      current=autotune.Settings(steps_per_execution=steps_per_execution),
      rounds=rounds, cached_only=cached_only,
      max_steps_per_execution=steps_per_execution)


def measure_one_device(*, size: str, seq_len: int, global_batch_size: int,
                       steps: int, steps_per_execution: int, rounds: int,
                       autotune: bool, cached_only: bool, seed: int = 0
                       ) -> dict[str, Any]:
  """Keras `fit` and tfmgpu's `one_device` path of `gpt`, in this process.

  Both are built once and timed in `rounds` interleaved rounds (best kept).
  `autotune`: tfmgpu's path trains with the autotune's choice (`tune`;
  `cached_only`: read from its cache, else the defaults).

  Returns:
    JSON-ready `{"matmul_gflops", "threads_per_op", "autotune": what it
    chose and why (its measured speed-ups) or None, "timings":
    {"keras_fit" | "one_device": Timing fields}}`.
  """
  text = text_arrays(seq_len)
  common = dict(size=size, global_batch_size=global_batch_size, steps=steps,
                steps_per_execution=steps_per_execution, seed=seed)
  layout, options, chose = Layout("one_device", "one_device"), {}, None
  if autotune:
    choice = tune(layout, text, size=size,
                  global_batch_size=global_batch_size,
                  steps_per_execution=steps_per_execution, rounds=rounds,
                  cached_only=cached_only, seed=seed)
    options = training_lib.tuned_options(choice.settings)
    chose = choice.describe()
  runs = {"keras_fit": keras_fit_runner(text, **common),
          "one_device": layout_runner(layout, text, **common,
                                      trainer_options=options)}
  best = training_lib.interleaved(
      {name: functools.partial(run, 1) for name, run in runs.items()},
      rounds)
  return {"matmul_gflops": ceiling.matmul_gflops(),
          "threads_per_op": tf.config.threading.get_intra_op_parallelism_threads(),
          "autotune": chose,
          "timings": {name: dataclasses.asdict(t) for name, t in best.items()}}


def measure_one_device_in_child(timeout_s: int = 1800, **kwargs: Any
                                ) -> tuple[dict[str, training_lib.Timing],
                                           dict[str, Any]]:
  """`measure_one_device(**kwargs)` in a child process that keeps
  TensorFlow's threads (every core per op), as a one-device run has them.

  Returns:
    `(timings by path, the rest of its result)`.

  Raises:
    RuntimeError: the child failed or took over `timeout_s` seconds.
  """
  result = child.call_in_child(
      "tfmgpu.benchmarks.language_model:measure_one_device", kwargs,
      timeout_s=timeout_s, what="the one-device language model measurement",
      alone="python -m tfmgpu.bench --sections=language_model --replicas=1 "
      "--virtual_devices=1")
  timings = {name: training_lib.Timing(**{**t, "rounds_ms": tuple(
      t["rounds_ms"])}) for name, t in result.pop("timings").items()}
  return timings, result


def keras_fit_runner(arrays: data_lib.Arrays, *, size: str,
                     global_batch_size: int, steps: int,
                     steps_per_execution: int, seed: int = 0
                     ) -> Callable[[int], training_lib.Timing]:
  """Keras `fit` of the unsplit model on one device, compiled once.

  Returns:
    `run(skip)`: one `fit` of `steps`, as `layout_runner`'s.
  """
  model = _build(arrays, size, seed)
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                steps_per_execution=steps_per_execution)
  per_epoch = max(steps // steps_per_execution, 3) * steps_per_execution
  dataset = tf.data.Dataset.from_tensor_slices(
      (arrays.x_train, arrays.y_train)).repeat().batch(
          global_batch_size, drop_remainder=True).take(per_epoch).prefetch(
              tf.data.AUTOTUNE)
  timer = training_lib.BatchTimer()

  def run(skip: int) -> training_lib.Timing:
    timer.times.clear()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[timer], shuffle=False)
    return training_lib.Timing(
        "keras_fit", training_lib.median_step_ms(timer.times,
                                                 steps_per_execution, skip),
        global_batch_size)
  return run


def flops_per_token(arrays: data_lib.Arrays, size: str) -> float:
  """Training FLOPs per token of `gpt` at `size`, counted layer by layer
  as the compute ceiling counts them (forward x 3)."""
  model = _build(arrays, size, 0)
  return ceiling.training_flops_per_example(model) / arrays.input_shape[0]


def tokens_per_sec(timing: training_lib.Timing, seq_len: int) -> float:
  """Tokens trained per second at `timing`'s step time."""
  return timing.examples_per_sec * seq_len


def pipeline_gain(arrays: data_lib.Arrays, *, size: str, num_stages: int,
                  micro_batches: Sequence[int], global_batch_size: int,
                  steps: int = 6, seed: int = 0, schedule: str = "gpipe",
                  virtual_stages: int = 1, concurrency: float | None = None
                  ) -> list[pipeline_overlap.OverlapRun]:
  """One `num_stages` split of `gpt` with M = 1 against each M of
  `micro_batches` (interleaved, one run per M): measured step times beside
  the simulator's from the stages' measured times. `virtual_stages=V`: the
  split has `num_stages * V` stages, stage `k` on device `k % num_stages`,
  run as interleaved 1F1B."""
  model = _build(arrays, size, seed)
  chunks = num_stages * virtual_stages
  plan = partition.plan_stages(
      model, chunks,
      devices=[f"/cpu:{i % num_stages}" for i in range(chunks)])
  x = tf.constant(arrays.x_train[:global_batch_size])
  y = tf.constant(arrays.y_train[:global_batch_size])

  def loss_fn(y_true, y_pred):
    per_example = tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True), axis=-1)
    return tf.nn.compute_average_loss(per_example,
                                      global_batch_size=global_batch_size)

  return [pipeline_overlap.compare_micro_batches(
      model, plan, x, y, loss_fn, micro_batches=m, steps=steps, warmup=2,
      schedule=schedule, virtual_stages=virtual_stages,
      concurrency=concurrency) for m in micro_batches]


def text_arrays(seq_len: int) -> data_lib.Arrays:
  """The `stdlib_text` windows of `seq_len` bytes (tokens only)."""
  return data_lib.load_dataset("stdlib_text", seq_len=seq_len)
