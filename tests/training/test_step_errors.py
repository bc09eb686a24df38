"""A step's TF errors that the user can fix are said in their terms."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.training import step_errors
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
                                          micro_batches=8)
  trainer = Trainer(pipe, optimizer="sgd", verbose=0)
  with pytest.raises(ValueError, match=r"^A batch of 5 examples has fewer "
                     r"rows than micro_batches=8 .* drop_remainder=True"):
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))


def _convnet():
  keras.utils.set_random_seed(0)
  return keras.Sequential([
      keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3, activation="relu"),
      keras.layers.Conv2D(2, 3, activation="relu"), keras.layers.Flatten(),
      keras.layers.Dense(3)])


def test_a_batch_leaving_a_replica_no_rows_is_named_or_trains():
  """A last batch of 1 row over 2 replicas leaves replica 1 none. Where the
  CPU's convolution gradient rejects an empty batch (Keras' fit fails too;
  the CPUs of earlier runs did), the error says so in the user's terms;
  where it takes one (an AVX2 AMD EPYC did), the step trains as one device
  does on the same rows: either is right, neither is silent."""
  x, y = _rows(9, (6, 6, 1))
  batches = lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = _convnet()
  trainer = Trainer(model, strategy=strategy, optimizer="sgd", verbose=0)
  try:
    trainer.fit(batches())
  except ValueError as e:
    assert re.match(r"A step failed in replica 1's part. If a batch had "
                    r"fewer rows than the 2 replicas .* drop_remainder=True",
                    str(e), re.S), e
    return
  alone = _convnet()
  Trainer(alone, optimizer="sgd", verbose=0).fit(batches())
  for a, b in zip(model.get_weights(), alone.get_weights()):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_an_error_in_one_replicas_part_is_said_in_the_users_terms():
  """The message itself, whatever this CPU's kernels do with no rows."""
  error = tf.errors.InvalidArgumentError(None, None, (
      "Graph execution error:\n\nDetected at node StatefulPartitionedCall/"
      "replica_1/sequential/conv2d/Conv2DBackpropFilter defined at (most "
      "recent call last):\n"
      "INVALID_ARGUMENT: Conv2DBackpropFilter: input batch is 0\n"
      "\t [[{{node StatefulPartitionedCall/replica_1/sequential/conv2d/"
      "Conv2DBackpropFilter}}]]"))
  explained = step_errors.explain(error, 2)
  assert str(explained).startswith(
      "A step failed in replica 1's part. If a batch had fewer rows than the "
      "2 replicas (a dataset's short last batch), that replica got none")
  assert "TF said: INVALID_ARGUMENT: Conv2DBackpropFilter" in str(explained)
  assert step_errors.explain(error, 1) is None


def test_a_label_the_logits_have_no_class_for_is_named():
  """Labels 0/1 under the default loss with a one-logit model: on one
  device TF's traceback, on replicas a short batch was blamed (a new
  user's trial)."""
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)],
                           name="one_logit")
  x = np.zeros((8, 3), np.float32)
  y = np.array([0, 1] * 4)
  with pytest.raises(ValueError, match=r"^A label of 1 is not a class of the "
                     r"model's output, which gives 1 logit\(s\) per example: "
                     r"sparse categorical cross-entropy \(the default loss\) "
                     r"takes labels 0\.\.0\. End the model with one logit per "
                     r"class \(Dense\(num_classes\)\)"):
    Trainer(model, verbose=0).fit(x, y, global_batch_size=8)
