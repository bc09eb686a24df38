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
import tensorflow as tf

from tfmgpu.training import allreduce as allreduce_lib

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def per_example_loss_fn(loss: str | Callable[..., Any] | None) -> LossFn:
  """Returns `fn(y_true, y_pred) -> per-example loss` (unreduced).

  Args:
    loss: `None` or `"sparse_categorical_crossentropy"` (from logits, the
      default), a Keras `Loss` object (its reduction is bypassed), or a
      function returning per-example losses.
  """
  if loss is None or loss == "sparse_categorical_crossentropy":
    def sparse_ce(y_true, y_pred):
      return keras.losses.sparse_categorical_crossentropy(
          y_true, tf.cast(y_pred, tf.float32), from_logits=True)
    return sparse_ce
  if isinstance(loss, keras.losses.Loss):
    return loss.call
  if isinstance(loss, str):
    fn = keras.losses.get(loss)
    return getattr(fn, "call", fn)
  if callable(loss):
    return loss
  raise ValueError(f"loss={loss!r} is not a loss name, Keras Loss or function.")


def correct_count(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
  """Number of examples whose arg-max logit equals the integer label."""
  pred = tf.argmax(y_pred, axis=-1, output_type=tf.int32)
  return tf.reduce_sum(tf.cast(tf.equal(pred, tf.cast(
      tf.reshape(y_true, tf.shape(pred)), tf.int32)), tf.float32))


def _uses_loss_scaling(optimizer: keras.optimizers.Optimizer) -> bool:
  return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def make_gradients_fn(model: keras.Model,
                      optimizer: keras.optimizers.Optimizer, *,
                      global_batch_size: int, loss: Any = None,
                      jit_compile: bool = False):
  """`grads(x, y) -> (loss share, predictions, gradients)` of one replica.

  The loss is averaged over the global batch (plus regularization), scaled
  for a `LossScaleOptimizer`; a placed model computes each part's backward
  on that part's device (`compute_loss_and_gradients`).

  Raises:
    ValueError: `jit_compile` for a model whose variables live on several
      devices.
  """
  per_example = per_example_loss_fn(loss)
  scaling = _uses_loss_scaling(optimizer)

  def scaled_loss(y_true, y_pred):
    return tf.nn.compute_average_loss(per_example(y_true, y_pred),
                                      global_batch_size=global_batch_size)

  def placed_grads(x, y):  # Each part's backward on that part's device.
    def objective(y_true, y_pred):
      value = scaled_loss(y_true, y_pred)
      return optimizer.scale_loss(value) if scaling else value
    total, y_pred, grads = model.compute_loss_and_gradients(
        x, y, objective,
        scale_regularization=optimizer.scale_loss if scaling else None)
    if scaling:
      total = total / optimizer.scale_loss(tf.constant(1.0))
    return total, y_pred, grads

  def tape_grads(x, y):
    with tf.GradientTape() as tape:
      y_pred = model(x, training=True)
      loss_value = scaled_loss(y, y_pred)
      if model.losses:
        loss_value += tf.nn.scale_regularization_loss(
            tf.add_n([tf.cast(l, tf.float32) for l in model.losses]))
      target = optimizer.scale_loss(loss_value) if scaling else loss_value
    return loss_value, y_pred, tape.gradient(target,
                                             model.trainable_variables)

  if hasattr(model, "compute_loss_and_gradients"):
    if jit_compile:
      raise ValueError(
          f"jit_compile=True is not supported for {type(model).__name__}: XLA "
          "cannot compile one step whose variables live on several devices. "
          "Use jit_compile=False.")
    return placed_grads
  return tf.function(tape_grads, jit_compile=True) if jit_compile else tape_grads


def make_train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer,
                    *, global_batch_size: int, loss: Any = None,
                    jit_compile: bool = False,
                    allreduce: allreduce_lib.AllReduceOptions | None = None
                    ) -> Callable[[tf.Tensor, tf.Tensor], dict[str, tf.Tensor]]:
  """Builds the per-replica training step.

  Args:
    model: the Keras model (built in the strategy's scope).
    optimizer: a built Keras optimizer (a `LossScaleOptimizer` for float16).
    global_batch_size: examples per step over all replicas.
    loss: see `per_example_loss_fn`.
    jit_compile: XLA-compile the forward/backward (not the update, whose
      variables may live on several devices).
    allreduce: if given, the step sums replica gradients itself (then clips
      and optionally compresses, see `allreduce.AllReduceOptions`); the
      caller must have called `allreduce.take_over_aggregation(optimizer)`.

  Returns:
    `step(x, y) -> {"loss": mean loss share, "correct": count, "count": n,
    "non_finite": 1 if the loss is NaN/inf}`,
    to be called once per replica inside `strategy.run`.
  """
  grads_fn = make_gradients_fn(model, optimizer,
                                global_batch_size=global_batch_size,
                                loss=loss, jit_compile=jit_compile)

  def step(x, y):
    loss_value, y_pred, grads = grads_fn(x, y)
    if allreduce is not None:
      grads = allreduce_lib.all_reduce_gradients(grads, allreduce)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return {"loss": loss_value, "correct": correct_count(y, y_pred),
            "count": tf.cast(tf.shape(y_pred)[0], tf.float32),
            "non_finite": tf.cast(~tf.math.is_finite(loss_value), tf.float32)}

  return step


def non_finite_weights(model: keras.Model) -> tf.Tensor:
  """Number of trainable variables holding a NaN or inf (0 when healthy).

  Checked once per `tf.function` call because a finite loss can hide a
  diverged model: on CPU, graph-mode ReLU maps NaN to 0, so NaN weights can
  still give finite logits and loss.
  """
  return tf.add_n([tf.cast(~tf.reduce_all(tf.math.is_finite(v)), tf.float32)
                   for v in model.trainable_variables])


def make_eval_step(model: keras.Model, *, loss: Any = None
                   ) -> Callable[[tf.Tensor, tf.Tensor], dict[str, tf.Tensor]]:
  """Builds the per-replica evaluation step: weighted sums, reduced by the caller.

  `mask` is 1 for real rows and 0 for the padding of the last batch.
  """
  per_example = per_example_loss_fn(loss)

  def step(x, y, mask):
    y_pred = model(x, training=False)
    pred = tf.argmax(y_pred, axis=-1, output_type=tf.int32)
    hits = tf.cast(tf.equal(pred, tf.cast(tf.reshape(y, tf.shape(pred)),
                                          tf.int32)), tf.float32)
    return {"loss_sum": tf.reduce_sum(per_example(y, y_pred) * mask),
            "correct": tf.reduce_sum(hits * mask),
            "count": tf.reduce_sum(mask)}

  return step
