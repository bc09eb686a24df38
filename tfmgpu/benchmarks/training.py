"""Side-by-side training throughput: tfmgpu's loop against its peers.

Every path trains the same model (same initial weights), on the same data,
under the same strategy and global batch, in one process, and is timed per
step *call* after a warm-up, so tracing is excluded. Figures are ratios
measured in one run; on a CPU split into logical devices they measure
overhead, not multi-GPU speed-up.

Paths:
  * `tfmgpu`: `Trainer.fit` (strategy.run + reduce in tf.function).
  * `keras_fit`: Keras `model.fit`, timed per batch with a callback.
  * `keras_fit_fused`: the same with tfmgpu's `FusedAdam` compiled in (how
    much of tfmgpu's lead a `fit` user gets by swapping the optimizer).
  * `tutorial`: the plain `strategy.run` loop of TF's custom-training
    tutorial (one step per `tf.function` call, Python iteration).
  * `floor`: a single-device `tf.function` step with no strategy at all
    (`floor_same_kernels`: the same with tfmgpu's kernels).

Each path is *prepared* once (`prepare_*`: model, optimizer, traced step)
and then timed round after round. `compare` runs the strategy paths'
rounds interleaved and keeps each one's best round (with every round's
time, for the spread of a ratio).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu.training import fused as fused_lib
from tfmgpu.training import objectives
from tfmgpu.training.loop import Trainer


@dataclasses.dataclass(frozen=True)
class Timing:
  """Median time per optimizer step of one path.

  Attributes:
    rounds_ms: when the path was timed in several interleaved rounds, each
      round's time in round order (`ms_per_step` is their minimum).
  """
  path: str
  ms_per_step: float
  global_batch_size: int
  rounds_ms: tuple[float, ...] = ()

  @property
  def examples_per_sec(self) -> float:
    return self.global_batch_size / (self.ms_per_step / 1e3)


# A path built (model, optimizer, traced step) and ready: each call times
# one more round of its steps.
Round = Callable[[], Timing]


def _batches(arrays, global_batch_size: int, steps: int):
  """`steps` batches of the training data, repeated as needed, prefetched."""
  return tf.data.Dataset.from_tensor_slices(
      (arrays.x_train, arrays.y_train)).repeat().batch(
          global_batch_size, drop_remainder=True).take(steps).prefetch(
              tf.data.AUTOTUNE)


def _build(strategy, model_name, arrays, seed):
  with strategy.scope():
    return models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                  num_classes=arrays.num_classes, seed=seed)


class BatchTimer(keras.callbacks.Callback):
  """Records the wall time between consecutive `on_train_batch_end` calls."""

  def __init__(self):
    super().__init__()
    self.times: list[float] = []

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(time.perf_counter())


def median_step_ms(stamps: list[float], steps_per_call: int,
                    skip: int) -> float:
  gaps = np.diff(stamps)[skip:]
  if not len(gaps):
    raise ValueError("too few timed calls; raise steps.")
  return float(statistics.median(gaps)) * 1e3 / steps_per_call


def prepare_tfmgpu(strategy, model_name, arrays, *, global_batch_size: int,
                   steps: int, steps_per_execution: int = 1, seed: int = 0,
                   jit_compile: bool = False, warmup: int = 1,
                   **trainer_options) -> Round:
  """`Trainer.fit`, timed per call of `steps_per_execution` steps.

  `trainer_options` go to `Trainer` (e.g. `gradient_compression`).
  """
  model = _build(strategy, model_name, arrays, seed)
  timer = BatchTimer()
  trainer = Trainer(model, strategy=strategy, steps_per_execution=
                    steps_per_execution, jit_compile=jit_compile, verbose=0,
                    callbacks=[timer], **trainer_options)
  per_epoch = len(arrays.x_train) // global_batch_size
  per_epoch = max(min(steps, per_epoch) // steps_per_execution, 1) * (
      steps_per_execution)

  def one_round() -> Timing:
    timer.times.clear()
    trainer.fit(arrays.x_train, arrays.y_train, epochs=-(-steps // per_epoch),
                global_batch_size=global_batch_size,
                steps_per_epoch=per_epoch, seed=seed)
    return Timing("tfmgpu",
                  median_step_ms(timer.times, steps_per_execution, warmup),
                  global_batch_size)
  return one_round


def prepare_keras_fit(strategy, model_name, arrays, *, global_batch_size: int,
                      steps: int, steps_per_execution: int = 1, seed: int = 0,
                      warmup: int = 1, fused_optimizer: bool = False) -> Round:
  """Keras `model.fit`, timed per batch callback (not by wall-clocking fit).

  `fused_optimizer` compiles tfmgpu's `FusedAdam` instead of Keras's Adam.
  """
  model = _build(strategy, model_name, arrays, seed)
  with strategy.scope():
    optimizer = keras.optimizers.Adam(1e-3)
    if fused_optimizer:
      optimizer = fused_lib.fuse(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
  timer = BatchTimer()
  ds = _batches(arrays, global_batch_size, steps)

  def one_round() -> Timing:  # Keras keeps its train function: no retrace.
    timer.times.clear()
    model.fit(ds, epochs=1, verbose=0, callbacks=[timer], shuffle=False)
    return Timing("keras_fit_fused" if fused_optimizer else "keras_fit",
                  median_step_ms(timer.times, steps_per_execution, warmup),
                  global_batch_size)
  return one_round


def prepare_tutorial_loop(strategy, model_name, arrays, *,
                          global_batch_size: int, steps: int, seed: int = 0,
                          warmup: int = 1) -> Round:
  """The custom loop of TF's distributed training tutorial, timed per step."""
  model = _build(strategy, model_name, arrays, seed)
  with strategy.scope():
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
  loss_obj = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none")

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.nn.compute_average_loss(loss_obj(y, model(x, training=True)),
                                        global_batch_size=global_batch_size)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  @tf.function
  def distributed_step(x, y):
    per_replica = strategy.run(replica_step, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

  ds = strategy.experimental_distribute_dataset(
      _batches(arrays, global_batch_size, steps))

  def one_round() -> Timing:
    stamps = []
    for x, y in ds:  # A new iterator each round.
      float(distributed_step(x, y))  # Read the loss, as fit and tfmgpu do.
      stamps.append(time.perf_counter())
    return Timing("tutorial", median_step_ms(stamps, 1, warmup),
                  global_batch_size)
  return one_round


def prepare_floor(model_name, arrays, *, global_batch_size: int, steps: int,
                  steps_per_execution: int = 1, seed: int = 0, warmup: int = 1,
                  same_kernels: bool = False) -> Round:
  """A bare single-device `tf.function` loop: the cost floor.

  Args:
    same_kernels: use what tfmgpu uses by default, `FusedAdam` and batches
      gathered from arrays held in memory, instead of Keras's Adam and a
      `tf.data` iterator; tfmgpu's cost over this floor is its loop alone.
  """
  model = models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                 num_classes=arrays.num_classes, seed=seed)
  optimizer = keras.optimizers.Adam(1e-3)
  if same_kernels:
    optimizer = fused_lib.fuse(optimizer)
  optimizer.build(model.trainable_variables)
  # The Trainer's loss (its default, in Keras' floatx), so the floor
  # computes what the Trainer computes.
  per_example = objectives.Objective(model, metrics=[]).per_example_loss
  if same_kernels:  # Held in memory, as tfmgpu's device-resident data.
    x_all, y_all = tf.constant(arrays.x_train), tf.constant(arrays.y_train)
    rows = tf.constant(np.resize(
        np.random.default_rng(seed).permutation(len(arrays.x_train)),
        (steps, global_batch_size)).astype(np.int32))
  else:
    batches = _batches(arrays, global_batch_size, steps)

  @tf.function
  def train(iterator, first_step, num_steps):
    total = tf.constant(0.0, objectives.loss_dtype())
    for i in tf.range(num_steps):
      if same_kernels:
        x = tf.gather(x_all, rows[first_step + i])
        y = tf.gather(y_all, rows[first_step + i])
      else:
        x, y = next(iterator)
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example(y, model(x, training=True)))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      total += loss
    return total

  def one_round() -> Timing:
    it = None if same_kernels else iter(batches)
    stamps = []
    for call in range(steps // steps_per_execution):
      float(train(it, tf.constant(call * steps_per_execution),
                  tf.constant(steps_per_execution)))
      stamps.append(time.perf_counter())
    return Timing("floor_same_kernels" if same_kernels else "floor",
                  median_step_ms(stamps, steps_per_execution, warmup),
                  global_batch_size)
  return one_round


def time_tfmgpu(*args: Any, **kwargs: Any) -> Timing:
  """Builds `prepare_tfmgpu`'s path and times one round of it."""
  return prepare_tfmgpu(*args, **kwargs)()

PATHS: dict[str, Callable[..., Round]] = {
    "tfmgpu": prepare_tfmgpu,
    "keras_fit": prepare_keras_fit,
    "keras_fit_fused": functools.partial(prepare_keras_fit,
                                         fused_optimizer=True),
    "tutorial": prepare_tutorial_loop,
}


def best_round(timings: list[Timing]) -> Timing:
  """The fastest of `timings` (one path's rounds), carrying every round."""
  best = min(timings, key=lambda t: t.ms_per_step)
  return dataclasses.replace(
      best, rounds_ms=tuple(t.ms_per_step for t in timings))


def compare(strategy, model_name: str, arrays: data_lib.Arrays, *,
            global_batch_size: int, steps: int, steps_per_execution: int = 1,
            rounds: int = 2, paths=("tfmgpu", "keras_fit"),
            tfmgpu_options: dict | None = None) -> dict[str, Timing]:
  """Times each path `rounds` times, interleaved; keeps each path's best round.

  Each path is built (and traced) once, then timed round after round, so
  a round costs only its steps and the rounds of all paths are close
  together in time. Interleaving spreads any drift of the machine over all
  paths equally. Each returned `Timing` holds every round's time
  (`rounds_ms`).

  Args:
    tfmgpu_options: `Trainer` options of the `tfmgpu` path only (e.g. an
      autotune's `jit_compile`); `steps_per_execution` is every path's.
  """
  built: dict[str, Round] = {}
  for path in paths:
    kwargs = dict(global_batch_size=global_batch_size, steps=steps)
    if path != "tutorial":
      kwargs["steps_per_execution"] = steps_per_execution
    if path == "tfmgpu":
      kwargs.update(tfmgpu_options or {})
    built[path] = PATHS[path](strategy, model_name, arrays, **kwargs)
  return interleaved(built, rounds)


def tuned_options(settings: Any) -> dict[str, Any]:
  """tfmgpu's own `Trainer` options from the autotune's `Settings` (the
  steps per call left out: every path of a comparison shares them)."""
  options = settings.as_dict()
  del options["steps_per_execution"]
  return options


def interleaved(built: dict[str, Round], rounds: int) -> dict[str, Timing]:
  """Each built path's best of `rounds` rounds, the paths taking turns."""
  runs: dict[str, list[Timing]] = {path: [] for path in built}
  for _ in range(rounds):
    for path, one_round in built.items():
      runs[path].append(one_round())
  return {path: best_round(timings) for path, timings in runs.items()}
