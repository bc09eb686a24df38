"""tfmgpu's loop on a shuffled `tf.data` input against `fit` and TF Orbit.

TF Model Garden's Orbit (`orbit.StandardTrainer`) is the reference custom
training loop of TensorFlow: a `strategy.run` step inside a `tf.while_loop`
over `num_steps`. This section trains the same model (same initial weights)
on the same shuffled, repeated `tf.data` pipeline of global batches with
each of the three, at each replica count, and times each path's calls of
`steps_per_execution` steps in the steady state: the median time between
calls, best of interleaved rounds (tracing and iterator creation left
out). Orbit is a bench-only extra:
`pip install --no-deps tf-models-official tf-keras`; without it the Orbit
column says so.

What each path runs (Adam 1e-3, sparse cross-entropy from logits):
  * `tfmgpu`: `Trainer.fit(dataset, steps_per_epoch=...)`, its defaults
    (fused Adam, `steps_per_execution` steps per call; on CPU replicas one
    host iterator whose batches the step splits, `tfmgpu.training.feeds`).
  * `tfmgpu_tf_iterator`: the same with `input_mode="tf_data"`: TF's
    distributed iterator, as `fit` and Orbit read the dataset (the host
    split's share of the lead).
  * `keras_fit`: `model.compile(steps_per_execution=...)` + `model.fit`.
  * `orbit`: `StandardTrainer` with `use_tf_while_loop=True`, one
    `strategy.run` step per loop iteration, Keras' Adam.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu.training import objectives
from tfmgpu.training.loop import Trainer

ORBIT_MISSING = ("not installed (pip install --no-deps tf-models-official "
                 "tf-keras)")


@dataclasses.dataclass(frozen=True)
class Row:
  """Examples/s of each path at one replica count (`None`: not measured)."""
  model: str
  replicas: int
  tfmgpu: float
  keras_fit: float
  orbit: float | None
  tfmgpu_tf_iterator: float | None = None

  @property
  def vs_fit(self) -> float:
    return self.tfmgpu / self.keras_fit

  @property
  def vs_orbit(self) -> float | None:
    return self.tfmgpu / self.orbit if self.orbit else None

  @property
  def host_split_gain(self) -> float | None:
    """tfmgpu's speed over itself reading through TF's iterator."""
    return (self.tfmgpu / self.tfmgpu_tf_iterator
            if self.tfmgpu_tf_iterator else None)


def shuffled_dataset(arrays: data_lib.Arrays, global_batch_size: int,
                     seed: int = 0) -> tf.data.Dataset:
  """The input every path reads: shuffled each pass, repeated, batched."""
  n = len(arrays.x_train)
  return (tf.data.Dataset.from_tensor_slices((arrays.x_train, arrays.y_train))
          .shuffle(n, seed=seed, reshuffle_each_iteration=True).repeat()
          .batch(global_batch_size, drop_remainder=True)
          .prefetch(tf.data.AUTOTUNE))


def _build(strategy, model_name: str, arrays: data_lib.Arrays, seed: int):
  with strategy.scope():
    return models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                  num_classes=arrays.num_classes, seed=seed)


Runner = Callable[[], list[float]]  # One run: the end time of each call.


class _Stamps(keras.callbacks.Callback):
  """The wall time of each `on_train_batch_end` (one per call of steps)."""

  def __init__(self):
    super().__init__()
    self.times: list[float] = []

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(time.perf_counter())


def tfmgpu_runner(strategy, model_name, arrays, dataset, *, steps: int,
                  steps_per_execution: int, seed: int = 0,
                  **trainer_options) -> Runner:
  """`Trainer.fit` on `dataset`; `trainer_options` go to the `Trainer`."""
  model = _build(strategy, model_name, arrays, seed)
  stamps = _Stamps()
  trainer = Trainer(model, strategy=strategy, verbose=0, callbacks=[stamps],
                    steps_per_execution=steps_per_execution,
                    **trainer_options)

  def run():
    stamps.times = []
    trainer.fit(dataset, steps_per_epoch=steps)
    return stamps.times
  return run


def keras_fit_runner(strategy, model_name, arrays, dataset, *, steps: int,
                     steps_per_execution: int, seed: int = 0) -> Runner:
  model = _build(strategy, model_name, arrays, seed)
  with strategy.scope():
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  steps_per_execution=steps_per_execution)
  stamps = _Stamps()

  def run():
    stamps.times = []
    model.fit(dataset, steps_per_epoch=steps, epochs=1, shuffle=False,
              verbose=0, callbacks=[stamps])  # tf.data shuffles.
    return stamps.times
  return run


def orbit_installed() -> bool:
  """Whether TF Model Garden's Orbit imports."""
  try:
    import orbit  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def orbit_runner(strategy, model_name, arrays, dataset, *, steps: int,
                 steps_per_execution: int, seed: int = 0) -> Runner | None:
  """Orbit's `StandardTrainer`, `steps_per_execution` steps per `train`
  call (one `tf.while_loop`); `None` when Orbit is not installed."""
  try:
    import orbit  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  model = _build(strategy, model_name, arrays, seed)
  with strategy.scope():
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
  batch = _batch(dataset)
  trainers_loss = objectives.Objective(model, metrics=[]).per_example_loss

  def replica_step(x, y):
    with tf.GradientTape() as tape:  # The loss as the Trainer computes it.
      per_example = trainers_loss(y, model(x, training=True))
      loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  class _Trainer(orbit.StandardTrainer):

    def train_loop_begin(self):
      pass

    def train_step(self, iterator):
      strategy.run(replica_step, args=next(iterator))

    def train_loop_end(self):
      return {}

  with strategy.scope():
    trainer = _Trainer(
        strategy.experimental_distribute_dataset(dataset),
        options=orbit.StandardTrainerOptions(use_tf_while_loop=True))
  calls = max(steps // steps_per_execution, 2)

  def run():
    times = []
    for _ in range(calls):
      trainer.train(tf.constant(steps_per_execution))
      times.append(time.perf_counter())
    return times
  return run


def best_rates(runners: dict[str, Runner | None], examples_per_call: int,
               rounds: int) -> dict[str, float | None]:
  """Examples/s of each runner: the median time between its calls (the
  first call of a run, which builds the iterator, left out), best round.
  Rounds interleave the runners, after one untimed (tracing) run each."""
  live = {k: r for k, r in runners.items() if r is not None}
  for run in live.values():
    run()
  best = {k: float("inf") for k in live}
  for _ in range(rounds):
    for name, run in live.items():
      gaps = np.diff(run())
      if len(gaps):
        best[name] = min(best[name], float(np.median(gaps)))
  return {k: (examples_per_call / best[k] if k in best else None)
          for k in runners}


def _batch(dataset: tf.data.Dataset) -> int:
  return int(dataset.element_spec[0].shape[0])


def compare(model_name: str, arrays: data_lib.Arrays, *, replicas: int,
            global_batch_size: int, steps: int,
            steps_per_execution: int = 10, rounds: int = 3,
            tf_iterator: bool = True) -> Row:
  """One row: the paths at `replicas` mirrored replicas (`tf_iterator`:
  also tfmgpu on TF's distributed iterator)."""
  strategy = strategies_lib.get_strategy("mirrored", num_replicas=replicas)
  dataset = shuffled_dataset(arrays, global_batch_size)
  common = (strategy, model_name, arrays, dataset)
  kwargs = dict(steps=steps, steps_per_execution=steps_per_execution)
  rates = best_rates({
      "tfmgpu": tfmgpu_runner(*common, **kwargs),
      "keras_fit": keras_fit_runner(*common, **kwargs),
      "orbit": orbit_runner(*common, **kwargs),
      "tfmgpu_tf_iterator": tfmgpu_runner(*common, input_mode="tf_data",
                                          **kwargs) if tf_iterator else None,
  }, steps_per_execution * global_batch_size, rounds)
  return Row(model=model_name, replicas=replicas, **rates)


def table(rows: list[Row]) -> str:
  """A Markdown table of examples/s and the two ratios."""
  lines = ["| model | replicas | tfmgpu ex/s | fit ex/s | Orbit ex/s | "
           "tfmgpu / fit | tfmgpu / Orbit |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    orbit_rate = f"{r.orbit:,.0f}" if r.orbit else ORBIT_MISSING
    vs_orbit = f"{r.vs_orbit:.2f}" if r.vs_orbit else "-"
    lines.append(f"| {r.model} | {r.replicas} | {r.tfmgpu:,.0f} | "
                 f"{r.keras_fit:,.0f} | {orbit_rate} | {r.vs_fit:.2f} | "
                 f"{vs_orbit} |")
  return "\n".join(lines)
