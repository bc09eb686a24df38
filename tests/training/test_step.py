"""Per-replica math: the loss share of the global batch, its update, the sums.

A Dense layer without bias and with known weights: logits = x @ W, so the
expected loss and gradient are a few lines of numpy.
"""

import keras
import numpy as np
import pytest

from tfmgpu.training import step as step_lib

W = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]], np.float32)
X = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 2.0]], np.float32)
Y = np.array([0, 0, 1], np.int32)  # Row 0 is predicted right, rows 1-2 wrong.
LEARNING_RATE = 0.5


def _dense():
  model = keras.Sequential([keras.Input((3,)),
                            keras.layers.Dense(2, use_bias=False)])
  model.set_weights([W])
  return model


def _cross_entropy(x, y):
  """Per-example sparse cross-entropy of x @ W, and its gradient in W."""
  logits = x @ W
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  losses = -np.log(p[np.arange(len(y)), y])
  d_logits = p - np.eye(2, dtype=np.float32)[y]
  return losses, x.T @ d_logits


@pytest.mark.parametrize("global_batch_size", [3, 12])
def test_train_step_loss_is_a_share_of_the_global_batch(global_batch_size):
  model = _dense()
  optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
  optimizer.build(model.trainable_variables)
  step = step_lib.make_train_step(model, optimizer,
                                  global_batch_size=global_batch_size)
  out = step(X, Y)

  losses, grad = _cross_entropy(X, Y)
  assert set(out) == {"loss", "correct", "count", "non_finite"}
  np.testing.assert_allclose(out["loss"], losses.sum() / global_batch_size,
                             rtol=1e-6)
  assert (float(out["correct"]), float(out["count"])) == (1.0, 3.0)
  assert float(out["non_finite"]) == 0.0
  # The update is the gradient of this replica's share, not of its mean.
  np.testing.assert_allclose(
      model.get_weights()[0], W - LEARNING_RATE * grad / global_batch_size,
      rtol=1e-6, atol=1e-7)


def test_train_step_flags_a_non_finite_loss():
  model = _dense()
  optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
  optimizer.build(model.trainable_variables)
  step = step_lib.make_train_step(model, optimizer, global_batch_size=3)
  out = step(np.full_like(X, np.nan), Y)
  assert float(out["non_finite"]) == 1.0
  assert float(step_lib.non_finite_weights(model)) == 1.0


def test_eval_step_sums_only_the_rows_the_mask_keeps():
  step = step_lib.make_eval_step(_dense())
  mask = np.array([1.0, 1.0, 0.0], np.float32)  # Row 2 is padding.
  out = step(X, Y, mask)

  losses, _ = _cross_entropy(X, Y)
  assert set(out) == {"loss_sum", "correct", "count"}
  np.testing.assert_allclose(out["loss_sum"], losses[:2].sum(), rtol=1e-6)
  assert (float(out["correct"]), float(out["count"])) == (1.0, 2.0)


def test_correct_count_compares_the_arg_max_with_the_label():
  logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]], np.float32)
  assert float(step_lib.correct_count(np.array([1, 1, 1]), logits)) == 2.0
  assert float(step_lib.correct_count(np.array([[1], [0], [1]]), logits)) == 3.0


def test_per_example_loss_accepts_names_losses_and_functions():
  y, logits = np.array([1, 0]), np.array([[0.0, 2.0], [1.0, 1.0]], np.float32)
  expected = keras.losses.sparse_categorical_crossentropy(
      y, logits, from_logits=True).numpy()
  for loss in (None, "sparse_categorical_crossentropy",
               keras.losses.SparseCategoricalCrossentropy(from_logits=True)):
    np.testing.assert_allclose(step_lib.per_example_loss_fn(loss)(y, logits),
                               expected, rtol=1e-6)
  with pytest.raises(ValueError, match=r"loss=3 is not a loss name, Keras Loss "
                     r"or function."):
    step_lib.per_example_loss_fn(3)
