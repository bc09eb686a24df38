"""A step's TF errors that the user can fix are said in their terms."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.training.loop import Trainer


def _rows(n, shape):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(n,) + shape).astype("float32"),
          rng.integers(0, 3, n))


def test_a_short_last_batch_under_micro_batches_is_named():
  """TF's Assert said it in 3 kB, its point at the end."""
  x, y = _rows(13, (6,))
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
      8, name="a"), keras.layers.Dense(3, name="b")])
  pipe = tfmgpu.PipelinedModel.from_model(model, num_stages=2,
                                          micro_batches=4)
  trainer = Trainer(pipe, optimizer="sgd", verbose=0)
  with pytest.raises(ValueError, match=r"^A batch of 5 examples is not "
                     r"divisible by micro_batches=4 .* drop_remainder=True"):
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))


def test_a_batch_leaving_a_replica_no_rows_is_named():
  """A convolution's gradient fails on the empty replica (Keras' fit too)."""
  x, y = _rows(9, (6, 6, 1))
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3, activation="relu"),
        keras.layers.Conv2D(2, 3, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(3)])
  trainer = Trainer(model, strategy=strategy, optimizer="sgd", verbose=0)
  with pytest.raises(ValueError, match=r"^A step failed in replica 1's "
                     r"part. If a batch had fewer rows than the 2 replicas "
                     r".* drop_remainder=True"):
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
