"""Every replica predicts and evaluates with the statistics the model saves."""

import keras
import numpy as np
import pytest

import tfmgpu
from tfmgpu.training import replica_state
from tfmgpu.training.loop import Trainer
from tests.training import faults


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


def _hybrid(devices):
  """`_bn_model` with named layers (checkpoints' portable view keys them),
  as 2 data copies of 2 stages."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  hidden = keras.layers.BatchNormalization(name="bn")(
      keras.layers.Dense(16, name="d1")(inputs))
  model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(
      keras.layers.Activation("relu", name="relu")(hidden)))
  return hybrid.build_layout(model, hybrid.Layout(
      data=2, stages=2, micro_batches=1), devices=devices)


def test_data_copies_of_a_placed_model_serve_the_first_copys_statistics(
    cpu_devices, tmp_path):
  """A hybrid (data 2 x stages 2) model's copies kept their own BatchNorm
  statistics: predict and evaluate served half of each batch with the
  second copy's (0.05 off `to_unsplit()`), and a resume (whose checkpoint
  gives every copy the first's) ended elsewhere than an uninterrupted run.
  """
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 6)).astype("float32")
  x[32:] += 1.0  # The copies' halves differ.
  y = rng.integers(0, 3, 64)
  fit = dict(epochs=2, global_batch_size=16, steps_per_epoch=4, shuffle=False)

  def trainer(model, model_dir, **kwargs):
    return Trainer(model, optimizer="sgd", learning_rate=0.05, verbose=0,
                   model_dir=str(model_dir), steps_per_execution=1, **kwargs)

  whole = _hybrid(cpu_devices)
  trainer(whole, tmp_path / "whole").fit(x, y, **fit)
  unsplit = whole.to_unsplit()
  # Equal to float32 rounding (the stages' ops fuse otherwise than the
  # unsplit model's: bit-equal on one CPU, 2.4e-7 apart on an AVX2 EPYC);
  # the second copy's statistics were 0.05 off.
  np.testing.assert_allclose(tfmgpu.predict(whole, x, batch_size=16),
                             unsplit.predict(x, batch_size=16, verbose=0),
                             rtol=0, atol=1e-6)
  with pytest.raises(faults.Killed):  # Mid-epoch 2, after the epoch-1 checkpoint.
    trainer(_hybrid(cpu_devices), tmp_path / "run",
            callbacks=[faults.KillAt(6)]).fit(x, y, **fit)
  resumed = _hybrid(cpu_devices)
  trainer(resumed, tmp_path / "run").fit(x, y, **fit)
  for a, b in zip(resumed.variables, whole.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
