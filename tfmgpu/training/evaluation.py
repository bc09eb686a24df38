"""The evaluation runner: loss and metrics over every row of an input.

`Evaluator` is what `Trainer.evaluate` and the validation after each epoch
of `Trainer.fit` run. It feeds a compiled `strategy.run` function
(`tfmgpu.training.distributed`) the way training is fed
(`tfmgpu.training.feeds`): arrays held on the replicas' devices
(`tfmgpu.training.resident`), a user's dataset split on the host, or TF's
distributed iterators. Arrays' last batch is padded and masked out, so no
row is dropped. The parameter-server variant, which evaluates on the
coordinator, is `tfmgpu.training.coordinator.CoordinatorEvaluator`.
"""

from __future__ import annotations

from typing import Any, Callable
import warnings

import keras
import tensorflow as tf

from tfmgpu.training import distributed
from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training import objectives
from tfmgpu.training import replica_state
from tfmgpu.training import resident
from tfmgpu.training import step as step_lib
from tfmgpu.training import string_inputs

# TF warns about its own `options()` call when a `tf.function` iterates a
# distributed dataset; nothing for the user to do.
_TF_DATA_OPTIONS_WARNING = "To make it possible to preserve tf.data options"

# Examples per validation step when `fit` has no global batch (a dataset).
DEFAULT_EVAL_BATCH = 256


class Evaluator:
  """Synchronous evaluation under `strategy.run`, device-resident if it can.

  Args:
    strategy: the strategy the model was built under.
    model: the model to evaluate.
    objective: its loss and metrics (`objectives.Objective`).
    input_mode: as for training: arrays are held on the devices under
      `"device"`, and under `"auto"` when they take at most half of
      `resident.DEFAULT_MAX_BYTES` (the other half is the training copy's);
      `"tf_data"` keeps a user's dataset on TF's distributed iterator.
  """

  def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model,
               objective: objectives.Objective, *, input_mode: str):
    self.strategy = strategy
    self.model = model
    self.objective = objective
    self.input_mode = input_mode
    self.functions: dict[bool, Any] = {}  # By `split_on_host`.
    self.resident_function = None
    self.held: tuple | None = None  # (key, source, batches, steps)

  def evaluate(self, source: inputs.InputData, global_batch_size: int,
               keep: bool = False) -> dict[str, float]:
    """`{"loss": mean loss, <metric>: value, ..., "count": rows}` of
    `source`; `keep` holds arrays on the devices for the next call
    (validation data during `fit`, until `release`)."""
    if (isinstance(source, inputs.DatasetData)
        and source.cardinality == inputs.INFINITE):
      raise ValueError("The dataset to evaluate is infinite (it repeats): "
                       "evaluation reads every batch once. Give it without "
                       ".repeat() (validation_data likewise).")
    string_inputs.check_source(self.model, source)
    replica_state.agree(self.model)  # Every replica evaluates as it saves.
    held = self._held_batches(source, global_batch_size, keep)
    if held is not None:
      out = self.resident_function(*held)
    else:
      split = (isinstance(source, inputs.DatasetData) and feeds.split_refusal(
          source, self.strategy, self.input_mode) is None)
      if split not in self.functions:
        self.functions[split] = self.make_function(split)
      with warnings.catch_warnings():  # TF's own, from tracing the loop.
        warnings.filterwarnings("ignore", message=_TF_DATA_OPTIONS_WARNING)
        out = self.functions[split](
            self.dataset(source, global_batch_size, split))
    sums = {k: v.numpy() for k, v in out.items()}
    n = max(float(sums["count"]), 1.0)
    result = {"loss": float(sums["loss_sum"]) / n}
    result.update(self.objective.results(sums))
    result["count"] = float(sums["count"])
    return result

  def validation(self, validation_data: Any, global_batch_size: int | None
                 ) -> Callable[[], dict[str, float]] | None:
    """The `val_` logs of `validation_data` after each epoch (`None`
    without it); its arrays stay on the devices until `release`."""
    if validation_data is None:
      return None
    source = inputs.from_validation_data(validation_data)
    batch = global_batch_size or DEFAULT_EVAL_BATCH

    def validate() -> dict[str, float]:
      val = self.evaluate(source, batch, keep=True)
      return {f"val_{k}": v for k, v in val.items() if k != "count"}

    return validate

  def release(self) -> None:
    """Drops the arrays held for validation (after each `fit`)."""
    self.held = None

  def make_function(self, split_on_host: bool) -> Callable[..., Any]:
    """The compiled evaluation of a dataset (`dataset`'s)."""
    return distributed.make_eval_function(
        self.strategy, step_lib.make_eval_step(self.model, loss=self.objective),
        split_on_host=split_on_host,
        metric_shapes=self.objective.state_shapes())

  def dataset(self, source: inputs.InputData, global_batch_size: int,
              split_on_host: bool) -> Any:
    """Every row once: arrays' last batch padded and masked out; a user's
    dataset as it comes, with a mask of ones (split over the replicas by
    the step with `split_on_host`, else by TF)."""
    if isinstance(source, inputs.DatasetData):
      masked = inputs.with_mask(source.dataset)
      return (masked if split_on_host
              else self.strategy.experimental_distribute_dataset(masked))
    if isinstance(source, inputs.DatasetFnData):
      return self.strategy.distribute_datasets_from_function(
          lambda ctx: inputs.with_mask(source.fn(ctx)))
    inputs.check_global_batch(global_batch_size,
                                self.strategy.num_replicas_in_sync)
    return inputs.distribute_arrays(
        self.strategy, source.padded(global_batch_size),
        global_batch_size=global_batch_size)

  def _held_batches(self, source: inputs.InputData, global_batch_size: int,
                    keep: bool) -> tuple | None:
    """`(batches, num_steps)` of arrays held on the devices, or `None` to
    read through `tf.data`. With `keep`, the copy (or the decision not to
    make one) is kept for the next call with the same arrays."""
    if (not isinstance(source, inputs.ArrayData)
        or not resident.supports(self.strategy)):
      return None
    key = (tuple(id(a) for a in tf.nest.flatten(source.data)),
           global_batch_size)
    if self.held is None or self.held[0] != key:
      inputs.check_global_batch(global_batch_size,
                                  self.strategy.num_replicas_in_sync)
      if not resident.use_device_data(
          self.input_mode, self.strategy, source.data,
          max_bytes=resident.DEFAULT_MAX_BYTES // 2):
        if keep:
          self.held = (key, source, None, None)
        return None
      held = resident.DeviceData(self.strategy,
                                 source.padded(global_batch_size))
      steps = held.num_examples // global_batch_size
      batches = held.epoch(global_batch_size=global_batch_size, steps=steps,
                           seed=0, epoch=0, shuffle=False).from_step(0)
      if self.resident_function is None:
        self.resident_function = distributed.make_resident_eval_function(
            self.strategy,
            step_lib.make_eval_step(self.model, loss=self.objective),
            metric_shapes=self.objective.state_shapes())
      if not keep:
        return batches, tf.constant(steps)
      # The source is kept so that the ids in the key stay its arrays'.
      self.held = (key, source, batches, steps)
    _, _, batches, steps = self.held
    return None if batches is None else (batches, tf.constant(steps))
