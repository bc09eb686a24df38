"""Per-replica math: the loss, gradients and update of one replica's batch.

This is the innermost of the three layers (step, distributed step, loop).
Nothing here knows how many devices there are, except that losses are
averaged over the *global* batch (`tf.nn.compute_average_loss`) so that the
all-reduced SUM of replica gradients is the gradient of the global mean.

A model that spreads itself over devices (a staged or pipelined model)
provides `compute_loss_and_gradients(x, y, loss_fn)`; the step then lets the
model run its own per-device backward instead of one `GradientTape`.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import placed_model
from tfmgpu.training import allreduce as allreduce_lib
from tfmgpu.training import batch_splits as batch_splits_lib
from tfmgpu.training import objectives
from tfmgpu.training import sharded

def as_objective(model: keras.Model, loss: Any = None
                 ) -> objectives.Objective:
  """`loss` as an `Objective` (an `Objective` is returned as it is)."""
  if isinstance(loss, objectives.Objective):
    return loss
  return objectives.Objective(model, loss)


def brings_own_backward(model: keras.Model) -> bool:
  """Whether `model` computes its own gradients, each part's on its own
  device (`compute_loss_and_gradients`: staged, pipelined, tensor-split
  and replicated models: `tfmgpu.parallel.placed_model.is_placed`)."""
  return placed_model.is_placed(model)


def make_gradients_fn(model: keras.Model,
                      optimizer: keras.optimizers.Optimizer, *,
                      global_batch_size: int | None,
                      objective: objectives.Objective,
                      jit_compile: bool = False, batch_splits: int = 1):
  """`grads(x, y, sw, batch) -> (loss share, predictions, gradients)`.

  The loss is averaged over the global batch (plus regularization), scaled
  for a `LossScaleOptimizer`; a placed model computes each part's backward
  on its device (`compute_loss_and_gradients`), targets and sample weights
  travelling together. `global_batch_size=None` takes `batch` (the caller
  sums the replicas' rows outside XLA, `_global_batch_of`). `batch_splits
  > 1`: row slices side by side (`training.batch_splits`), under XLA each
  its own compiled call (TF runs such calls side by side).

  Raises:
    ValueError: `jit_compile` for variables on several devices, or
      `batch_splits` the model cannot take."""
  batch_splits_lib.check(model, batch_splits)
  scaling = allreduce_lib.uses_loss_scaling(optimizer)

  def scaled_loss(target, y_pred, batch=None):
    y_true, sample_weight = target
    return tf.nn.compute_average_loss(
        objective.per_example_loss(y_true, y_pred, sample_weight),
        global_batch_size=global_batch_size or batch)  # None: the step's.

  def placed_grads(x, y, sw=None, batch=None):  # Parts on their devices.
    # Micro-batches share the whole batch's denominator (`batch`: a
    # dataset's batch is known only in the step, before the model splits it).
    def loss_fn(target, y_pred):
      value = scaled_loss(target, y_pred, batch)
      return optimizer.scale_loss(value) if scaling else value
    total, y_pred, grads = model.compute_loss_and_gradients(
        x, (y, sw), loss_fn,
        scale_regularization=optimizer.scale_loss if scaling else None)
    if scaling:
      total = total / optimizer.scale_loss(tf.constant(1.0))
    return total, y_pred, grads

  def tape_grads(x, y, sw=None, batch=None):
    with tf.GradientTape() as tape:
      y_pred = model(x, training=True)
      loss_value = scaled_loss((y, sw), y_pred, batch) + _regularization(
          model, objective.loss_dtype)
      target = optimizer.scale_loss(loss_value) if scaling else loss_value
    parts = sharded.trainable_parts(model)  # Split over servers: parts.
    return loss_value, y_pred, tape.gradient(target, parts)

  if brings_own_backward(model):
    if jit_compile:
      raise ValueError(
          f"jit_compile=True is not supported for {type(model).__name__}: XLA "
          "cannot compile one step whose variables live on several devices. "
          "Use jit_compile=False.")
    return placed_grads
  grads = (tf.function(tape_grads, jit_compile=True) if jit_compile
           else tape_grads)
  return (batch_splits_lib.over_slices(grads, model, batch_splits)
          if batch_splits > 1 else grads)


def _regularization(model: keras.Model, dtype: str) -> tf.Tensor | float:
  """The model's regularization losses in the loss's `dtype` (as Keras
  sums them), scaled for the replica count."""
  if not model.losses:
    return 0.0
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  if replicas > 1:
    microbatch.say_call_losses(f"Model {model.name!r}",
                               microbatch.loss_adders(model),
                               f"each of the {replicas} replicas' rows")
  return tf.nn.scale_regularization_loss(_added_losses(model, dtype))


def _added_losses(model: keras.Model, dtype: str) -> tf.Tensor:
  """The sum of `model.losses` (regularisation, `add_loss`) in `dtype`."""
  return tf.add_n([tf.cast(tf.reduce_sum(l), dtype) for l in model.losses])


def _global_batch_of(x: Any) -> tf.Tensor:
  """The rows of the step's batch over all replicas (call in replica
  context): summed, as a short last batch of a distributed dataset gives
  the replicas unequal shares (1 row over 2 replicas: 1 and 0)."""
  context = tf.distribute.get_replica_context()
  rows = tf.shape(tf.nest.flatten(x)[0])[0]
  if context.num_replicas_in_sync == 1:
    return rows
  total = context.all_reduce(tf.distribute.ReduceOp.SUM,
                             tf.cast(rows, tf.float32))
  return tf.cast(total, tf.int32)


def batch_count(y_pred: Any) -> tf.Tensor:
  """The number of examples in a batch of predictions (any structure)."""
  return tf.cast(tf.shape(tf.nest.flatten(y_pred)[0])[0], tf.float32)


def make_train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer,
                    *, global_batch_size: int | None, loss: Any = None,
                    jit_compile: bool = False, batch_splits: int = 1,
                    allreduce: allreduce_lib.AllReduceOptions | None = None
                    ) -> Callable[..., dict[str, tf.Tensor]]:
  """Builds the per-replica training step.

  Args:
    model: the Keras model (built in the strategy's scope).
    optimizer: a built Keras optimizer (a `LossScaleOptimizer` for float16).
    global_batch_size: examples per step over all replicas (`None`: the
      replicas' rows summed, with one scalar all-reduce, unless the caller
      passes `global_batch`).
    loss: an `objectives.Objective`, or a loss for one (`as_objective`).
    jit_compile: XLA-compile the forward/backward (not the update, whose
      variables may live on several devices).
    batch_splits: row slices of each replica's batch computed side by side
      (`tfmgpu.training.batch_splits`); 1 (the default): the whole batch.
    allreduce: if given, the step sums replica gradients itself (then clips
      and optionally compresses, see `allreduce.AllReduceOptions`); the
      caller must have called `allreduce.take_over_aggregation(optimizer)`.

  Returns:
    `step(x, y, sample_weight=None, global_batch=None) -> {"loss": mean
    loss share, "loss_rows": it times the step's rows (Keras weighs an
    epoch's losses by rows), "count": n, "non_finite": 1 if the loss is
    NaN/inf, **metric state changes}`, to be called once per replica inside `strategy.run`;
    `global_batch` (the rows of the whole step's batch, a tensor) sets the
    loss's denominator when `global_batch_size` is `None`, so a short last
    batch split unevenly is averaged as one device would.
  """
  objective = as_objective(model, loss)
  grads_fn = make_gradients_fn(model, optimizer,
                               global_batch_size=global_batch_size,
                               objective=objective, jit_compile=jit_compile,
                               batch_splits=batch_splits)

  reduce_within = (model.reduce_gradients
                   if hasattr(model, "reduce_gradients") else None)

  def step(x, y, sample_weight=None, global_batch=None):
    if global_batch_size is None and global_batch is None:
      # Here, not in `grads_fn`: an all-reduce cannot run inside XLA.
      global_batch = _global_batch_of(x)
    loss_value, y_pred, grads = grads_fn(x, y, sample_weight, global_batch)
    if reduce_within is not None:  # A placed model combines its own.
      grads = reduce_within(grads, allreduce)
    elif allreduce is not None:
      grads = allreduce_lib.all_reduce_gradients(grads, allreduce)
    optimizer.apply_gradients(zip(grads, sharded.trainable_parts(model)))
    rows = global_batch_size if global_batch is None else global_batch
    out = {"loss": loss_value, "count": batch_count(y_pred),
           "loss_rows": loss_value * tf.cast(rows, loss_value.dtype),
           "non_finite": tf.cast(~tf.math.is_finite(loss_value), tf.float32)}
    out.update(objective.metric_updates(y, y_pred, sample_weight))
    return out

  return step


def non_finite_weights(model: keras.Model) -> tf.Tensor:
  """Number of weights holding a NaN or inf (0 when healthy): trainable
  ones, and BatchNorm's moving statistics (a batch with a 1e30 row made
  `moving_variance` inf while training went on, and the checkpoints and
  the saved model kept it). Other non-trainable weights are left out: a
  frozen base (LoRA) never changes, and reading it every call would cost
  a pass over the model.

  Checked once per `tf.function` call because a finite loss can hide a
  diverged model: on CPU, graph-mode ReLU maps NaN to 0, so NaN weights can
  still give finite logits and loss.
  """
  weights = list(model.trainable_variables) + [
      v for v in _running_statistics(model) if _finite_now(v)]
  return tf.add_n([tf.cast(~tf.reduce_all(tf.math.is_finite(v)), tf.float32)
                   for v in weights])


def _running_statistics(model: keras.Model) -> list[Any]:
  """The moving statistics of `model`'s BatchNormalization layers (and
  their subclasses'), each once."""
  found: dict[int, Any] = {}
  for layer in _compat.flatten_layers(model):
    if isinstance(layer, keras.layers.BatchNormalization):
      found.update((id(v), v) for v in layer.non_trainable_weights)
  return list(found.values())


def _finite_now(variable: Any) -> bool:
  """Whether a statistic holds no NaN/inf when the step is traced: one
  that does already (restored so) is not this run's divergence."""
  with tf.init_scope():  # Its value now, also while tracing.
    return bool(np.isfinite(np.asarray(variable.numpy(), np.float64)).all())


def make_eval_step(model: keras.Model, *, loss: Any = None
                   ) -> Callable[..., dict[str, tf.Tensor]]:
  """Builds the per-replica evaluation step: weighted sums, reduced by the caller.

  `mask` is 1 for real rows and 0 for the padding of the last batch; it
  multiplies the user's sample weights, if any.

  Returns:
    `step(x, y, mask, sample_weight=None) -> {"loss_sum", "count",
    **metric state changes}`.
  """
  objective = as_objective(model, loss)

  def step(x, y, mask, sample_weight=None):
    y_pred = model(x, training=False)
    count = tf.reduce_sum(mask)
    loss_mask = tf.cast(mask, objective.loss_dtype)
    loss_sum = tf.reduce_sum(
        objective.per_example_loss(y, y_pred, sample_weight) * loss_mask)
    if model.losses:  # Regularisation, per example, as in training.
      loss_sum += tf.reduce_sum(loss_mask) * _added_losses(
          model, objective.loss_dtype)
    out = {"loss_sum": loss_sum, "count": count}
    out.update(objective.metric_updates(y, y_pred, sample_weight, mask=mask))
    return out

  return step
