"""Per-replica math: the loss share of the global batch, its update, the sums.

A Dense layer without bias and with known weights: logits = x @ W, so the
expected loss and gradient are a few lines of numpy.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.training import objectives
from tfmgpu.training import step as step_lib

W = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]], np.float32)
X = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 2.0]], np.float32)
Y = np.array([0, 0, 1], np.int32)  # Row 0 is predicted right, rows 1-2 wrong.
LEARNING_RATE = 0.5
ACCURACY = ("metric/accuracy/0", "metric/accuracy/1")  # Its total and count.


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
  assert set(out) == {"loss", "loss_rows", "count", "non_finite", *ACCURACY}
  np.testing.assert_allclose(out["loss"], losses.sum() / global_batch_size,
                             rtol=1e-6)
  # The accuracy's state change: 1 right of 3.
  assert [float(out[k]) for k in ACCURACY] == [1.0, 3.0]
  assert float(out["count"]) == 3.0
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
  assert set(out) == {"loss_sum", "count", *ACCURACY}
  np.testing.assert_allclose(out["loss_sum"], losses[:2].sum(), rtol=1e-6)
  assert [float(out[k]) for k in ACCURACY] == [1.0, 2.0]
  assert float(out["count"]) == 2.0


def test_eval_step_weights_rows_by_mask_times_sample_weight():
  step = step_lib.make_eval_step(_dense())
  mask = np.array([1.0, 1.0, 0.0], np.float32)
  weight = np.array([2.0, 0.5, 9.0], np.float32)
  out = step(X, Y, mask, weight)

  losses, _ = _cross_entropy(X, Y)
  np.testing.assert_allclose(out["loss_sum"], 2.0 * losses[0] + 0.5 * losses[1],
                             rtol=1e-6)
  # Metrics ignore sample weights, as in Keras: 1 right of 2 real rows.
  assert [float(out[k]) for k in ACCURACY] == [1.0, 2.0]
  # Weighted metrics take them: row 0 right (2.0), row 1 wrong (0.5).
  model = _dense()
  weighted = step_lib.make_eval_step(model, loss=objectives.Objective(
      model, weighted_metrics=["accuracy"]))(X, Y, mask, weight)
  assert [float(weighted[k.replace("accuracy", "weighted_accuracy")])
          for k in ACCURACY] == [2.0, 2.5]


def test_a_short_last_batch_of_tfs_iterator_averages_over_its_rows(
    cpu_devices):
  """TF's distributed iterator gives 1 row to one replica and 0 to the
  other: each divided by 1 x 2 replicas, and trained 0.66 off Keras."""
  import tfmgpu  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = rng.normal(size=(9, 5)).astype("float32")
  y = rng.randint(0, 3, 9).astype("int32")

  def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))

  data = lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.5),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
  reference.fit(data(), epochs=1, verbose=0)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = build()
  Trainer(model, strategy=strategy, optimizer=keras.optimizers.SGD(0.5),
          metrics=[], verbose=0, input_mode="tf_data").fit(data(), epochs=1)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-6)
