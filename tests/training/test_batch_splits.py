"""Batch splits: row slices of each replica's batch trained side by side
equal the whole batch, and models they cannot train exactly are refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import models
from tfmgpu.training import batch_splits
from tfmgpu.training.loop import Trainer

T, VOCAB = 16, 32


def _tokens(n=192, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, VOCAB, size=(n, T + 1)).astype(np.int32)
  return x[:, :-1], x[:, 1:]


def _train(strategy=None, **options):
  """3 steps of gpt tiny (its embedding's gradient is IndexedSlices);
  its weights and the last epoch's loss and accuracy."""
  x, y = _tokens()
  strategy = strategy or tf.distribute.get_strategy()
  with strategy.scope():
    model = models.build_model("gpt", input_shape=(T,), num_classes=VOCAB,
                               size="tiny", seed=0)
  result = Trainer(model, strategy=strategy, verbose=0, optimizer="sgd",
                   learning_rate=0.5, steps_per_execution=3,
                   **options).fit(x, y, epochs=1, global_batch_size=64,
                                  seed=0)
  return [v.numpy() for v in model.trainable_variables], result.history


@pytest.fixture(scope="module")
def unsplit():
  return _train()


@pytest.mark.parametrize("splits, jit, replicas", [(2, False, 1),
                                                   (3, True, 2)])
def test_batch_splits_train_as_the_whole_batch(unsplit, cpu_devices, splits,
                                               jit, replicas):
  strategy = (tf.distribute.MirroredStrategy(cpu_devices[:replicas])
              if replicas > 1 else None)
  weights, history = _train(strategy, batch_splits=splits, jit_compile=jit)
  base_weights, base_history = unsplit
  assert max(float(np.max(np.abs(a - b)))
             for a, b in zip(base_weights, weights)) < 1e-5
  for name in ("loss", "accuracy"):
    np.testing.assert_allclose(history[name], base_history[name], atol=1e-5)


def test_sparse_gradients_stay_sparse_and_slices_cover_every_row():
  seen = []

  def grads_fn(x, y, sw, batch):
    seen.append(int(tf.shape(x)[0]))
    rows = tf.IndexedSlices(tf.ones([tf.shape(x)[0], 2]), x[:, 0],
                            tf.constant([10, 2]))
    return tf.reduce_sum(tf.cast(x, tf.float32)), x * 2, [rows, 1.0]

  x = tf.reshape(tf.range(7), (7, 1))
  model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
  loss, y_pred, (sparse, dense) = batch_splits.over_slices(
      grads_fn, model, 3)(x, None)
  assert seen == [2, 2, 3]
  assert isinstance(sparse, tf.IndexedSlices)
  assert sorted(sparse.indices.numpy().tolist()) == list(range(7))
  assert float(loss) == 21.0 and float(dense) == 3.0
  np.testing.assert_array_equal(y_pred.numpy(), x.numpy() * 2)


def _refusal(model, splits=2):
  with pytest.raises(ValueError) as e:
    Trainer(model, verbose=0, batch_splits=splits)
  return str(e.value)


def test_models_that_cannot_train_in_splits_are_refused_by_name():
  bn = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                         keras.layers.BatchNormalization(name="bn1")])
  message = _refusal(bn)
  assert "batch_splits=2" in message and "bn1" in message
  assert "batch_splits=1" in message
  regularized = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
      3, kernel_regularizer="l2")])
  assert "regularizers" in _refusal(regularized)
  assert "positive int" in _refusal(regularized, splits=0)
  Trainer(bn, verbose=0, batch_splits=1)  # One piece: any model.


class _AddsLoss(keras.layers.Layer):

  def call(self, x):
    self.add_loss(tf.reduce_mean(x))
    return x


def test_a_loss_added_in_call_is_refused_when_the_step_is_traced():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                            _AddsLoss()])
  trainer = Trainer(model, verbose=0, batch_splits=2, loss="mse",
                    metrics=[])
  x = np.ones((8, 4), np.float32)
  with pytest.raises(ValueError, match="add_loss"):
    trainer.fit(x, np.zeros((8, 3), np.float32), epochs=1,
                global_batch_size=4)


@pytest.mark.parametrize("splits", [1, 3])
def test_under_xla_each_slice_is_its_own_compiled_call(splits):
  """One compiled call per slice, so that TF runs them side by side (one
  compiled step holding every slice would run them one after another)."""
  from tfmgpu.training import step  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  grads = step.make_gradients_fn(
      model, keras.optimizers.SGD(), global_batch_size=6,
      objective=step.as_objective(model, "mse"), jit_compile=True,
      batch_splits=splits)
  graph = tf.function(lambda x, y: grads(x, y)[2]).get_concrete_function(
      tf.TensorSpec([6, 4]), tf.TensorSpec([6, 3])).graph
  compiled = [op for op in graph.get_operations()
              if op.type.endswith("PartitionedCall")
              and op.get_attr("_XlaMustCompile")]
  assert len(compiled) == splits
