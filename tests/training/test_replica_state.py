"""Every replica predicts and evaluates with the statistics the model saves."""

import keras
import numpy as np
import pytest

import tfmgpu
from tfmgpu.training import replica_state
from tfmgpu.training.loop import Trainer


def _bn_model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  hidden = keras.layers.BatchNormalization(name="bn")(
      keras.layers.Dense(16)(inputs))
  return keras.Model(inputs, keras.layers.Dense(3)(
      keras.layers.Activation("relu")(hidden)))


def _copies(model):
  return [np.asarray(v) for v in model.get_layer("bn").moving_mean.value.values]


@pytest.mark.parametrize("trained_by", ["trainer", "keras_fit"])
def test_replicas_serve_the_first_replicas_batchnorm_statistics(trained_by):
  """Each replica updated its own copy: rows served by replica 1 were
  0.05 off the saved model, and the batch size changed predictions."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(96, 6)).astype("float32")
  y = rng.integers(0, 3, 96)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = _bn_model()
  if trained_by == "keras_fit":
    with strategy.scope():
      model.compile(optimizer="adam", loss=keras.losses.
                    SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    first, second = _copies(model)
    assert np.abs(first - second).max() > 1e-3  # Keras' replicas differ.
  else:
    Trainer(model, strategy=strategy, optimizer="adam", verbose=0).fit(
        x, y, global_batch_size=8, epochs=2)
  saved = _bn_model()
  saved.set_weights(model.get_weights())  # The first replica's, as saved.
  want = saved.predict(x[:33], verbose=0)
  np.testing.assert_allclose(tfmgpu.predict(model, x[:33]), want, atol=1e-6)
  np.testing.assert_allclose(tfmgpu.predict(model, x[:33], batch_size=8),
                             want, atol=1e-6)
  first, second = _copies(model)
  np.testing.assert_array_equal(first, second)
  assert replica_state.diverging(model)  # The statistics, by their kind.
  assert not replica_state.diverging(saved)  # Not mirrored.
