"""The distribution wrapper: SUM over the steps of a call and over replicas.

A MirroredStrategy over 2 of the logical CPUs, with ReductionToOneDevice so
that it never clashes with the 4-replica collectives of other tests.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.training import distributed
from tfmgpu.training import objectives
from tfmgpu.training import step as step_lib

GLOBAL_BATCH = 4
ROWS = np.arange(40, dtype=np.float32).reshape(20, 2)
LABELS = np.arange(20, dtype=np.int32) % 2


@pytest.fixture(scope="module")
def strategy():
  devices = tf.config.list_logical_devices("CPU")[:2]
  return tf.distribute.MirroredStrategy(
      [d.name for d in devices],
      cross_device_ops=tf.distribute.ReductionToOneDevice())


def _batches(strategy, *arrays):
  dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(GLOBAL_BATCH)
  return strategy.experimental_distribute_dataset(dataset)


def _dense(strategy):
  """Logits = x @ W, with W on every replica."""
  with strategy.scope():
    model = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(2, use_bias=False)])
  model.set_weights([np.array([[0.1, -0.2], [0.0, 0.05]], np.float32)])
  return model


COUNTED = {"metric/ones": (2,)}  # A shaped sum: [1 per replica, its rows].


def _counting_step(x, y):
  """Per replica: the sum of its rows, its count, and a shaped sum."""
  del y
  rows = tf.cast(tf.shape(x)[0], tf.float32)
  return {"loss": tf.reduce_sum(x), "metric/ones": tf.stack([1.0, rows]),
          "count": rows, "non_finite": tf.constant(0.0),
          "loss_rows": tf.reduce_sum(x) * rows}


def _right(labels, logits):
  return float(np.sum(np.argmax(np.asarray(logits), -1) == labels))


def test_train_function_sums_over_steps_and_replicas(strategy):
  train = distributed.make_train_function(
      strategy, _counting_step, check_fn=lambda: tf.constant(2.0),
      metric_shapes=COUNTED)
  iterator = iter(_batches(strategy, ROWS, LABELS))

  first = train(iterator, tf.constant(3))
  assert float(first["loss"]) == ROWS[:12].sum()
  assert list(first["metric/ones"].numpy()) == [3 * 2, 12]  # Steps x replicas.
  assert float(first["count"]) == 12
  assert float(first["non_finite"]) == 2.0  # check_fn, once per call.
  # The next call starts from zero and continues the iterator.
  second = train(iterator, tf.constant(2))
  assert float(second["loss"]) == ROWS[12:20].sum()
  assert list(second["metric/ones"].numpy()) == [4.0, 8.0]
  assert float(second["count"]) == 8.0
  assert train.experimental_get_tracing_count() == 1  # num_steps is a tensor.


def test_replica_loss_shares_add_up_to_the_global_mean(strategy):
  model = _dense(strategy)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(learning_rate=0.0)  # Weights stay put.
    optimizer.build(model.trainable_variables)
  objective = objectives.Objective(model)
  train = distributed.make_train_function(strategy, step_lib.make_train_step(
      model, optimizer, global_batch_size=GLOBAL_BATCH, loss=objective),
                                          metric_shapes=objective.state_shapes())
  out = train(iter(_batches(strategy, ROWS, LABELS)), tf.constant(5))

  per_example = keras.losses.sparse_categorical_crossentropy(
      LABELS, model(ROWS), from_logits=True).numpy()
  step_means = per_example.reshape(5, GLOBAL_BATCH).mean(axis=1)
  np.testing.assert_allclose(float(out["loss"]), step_means.sum(), rtol=1e-5)
  assert float(out["count"]) == 20
  assert objective.results(out)["accuracy"] == pytest.approx(
      _right(LABELS, model(ROWS)) / 20)


def test_eval_function_sums_every_batch_on_every_replica(strategy):
  model = _dense(strategy)
  objective = objectives.Objective(model)
  evaluate = distributed.make_eval_function(
      strategy, step_lib.make_eval_step(model, loss=objective),
      metric_shapes=objective.state_shapes())
  mask = (np.arange(20) < 17).astype(np.float32)  # The last 3 rows: padding.
  out = evaluate(_batches(strategy, ROWS, LABELS, mask))

  logits = model(ROWS[:17])
  per_example = keras.losses.sparse_categorical_crossentropy(
      LABELS[:17], logits, from_logits=True).numpy()
  assert set(out) == {"loss_sum", "count", *objective.state_shapes()}
  np.testing.assert_allclose(float(out["loss_sum"]), per_example.sum(),
                             rtol=1e-5)
  assert objective.results(out)["accuracy"] == pytest.approx(
      _right(LABELS[:17], logits) / 17)
  assert float(out["count"]) == 17
