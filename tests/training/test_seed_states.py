"""`seed_states`: Dropout's random state saved with the checkpoint, so a
resumed run draws the masks an uninterrupted one draws."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.parallel import hybrid
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import staged
from tfmgpu.training import checkpoints
from tfmgpu.training import seed_states
from tfmgpu.training.loop import Trainer
from tests.training import faults

FIT = dict(epochs=2, global_batch_size=16, steps_per_epoch=4)
_ROWS = np.random.default_rng(0)
X = _ROWS.normal(size=(64, 8)).astype("float32")
Y = (np.abs(X[:, :4]).argmax(1)).astype("int32")


def _unsplit():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu", name="d1")(inputs)
  h = keras.layers.Dropout(0.3, name="drop")(h)  # Unseeded: the global seed.
  h = keras.layers.Dense(16, activation="relu", name="d2")(h)
  h = keras.layers.Dropout(0.3, seed=5, name="drop2")(h)
  return keras.Model(inputs, keras.layers.Dense(4, name="logits")(h))


def _model(layout, devices):
  if layout == "one_device":
    return _unsplit()
  if layout == "staged":
    return staged.StagedModel.from_model(_unsplit(), num_stages=2,
                                         devices=devices[:2])
  if layout == "hybrid":
    return hybrid.build_layout(_unsplit(), hybrid.Layout(data=2, stages=2,
                                                         micro_batches=2))
  return pipeline.PipelinedModel.from_model(
      _unsplit(), num_stages=2, micro_batches=4, devices=devices[:2])


def _trainer(model, model_dir, **kwargs):
  return Trainer(model, strategy=tf.distribute.get_strategy(), verbose=0,
                 steps_per_execution=1, optimizer="adam", learning_rate=1e-2,
                 model_dir=str(model_dir), **kwargs)


def _states(model):
  return {name: [v.numpy().tolist() for v in states]
          for name, states in seed_states.by_layer_name(model).items()}


@pytest.mark.parametrize("layout", ["one_device", "pipelined", "hybrid"])
def test_a_resumed_dropout_model_ends_as_the_uninterrupted_one(
    layout, tmp_path, cpu_devices):
  """Before the seed states were saved the resumed run replayed the masks
  of the first steps: 0.03..0.1 away after 8 steps, silently."""
  whole = _model(layout, cpu_devices)
  _trainer(whole, tmp_path / "whole").fit(X, Y, **FIT)
  with pytest.raises(faults.Killed):  # After the epoch-1 checkpoint, mid-epoch 2.
    _trainer(_model(layout, cpu_devices), tmp_path / "run",
             callbacks=[faults.KillAt(6)]).fit(X, Y, **FIT)
  resumed = _model(layout, cpu_devices)
  result = _trainer(resumed, tmp_path / "run").fit(X, Y, **FIT)
  assert (result.initial_epoch, result.steps) == (1, 4)
  assert _states(resumed) == _states(whole)
  for a, b in zip(resumed.get_weights(), whole.get_weights()):
    np.testing.assert_array_equal(a, b)


def _saved(model, model_dir, epoch=1):
  optimizer = keras.optimizers.SGD()
  checkpointer = checkpoints.Checkpointer(
      str(model_dir), tf.distribute.get_strategy(), model=model,
      optimizer=optimizer)
  return checkpointer.save(epoch, step=epoch)


def _restore(model, model_dir):
  checkpointer = checkpoints.Checkpointer(
      str(model_dir), tf.distribute.get_strategy(), model=model,
      optimizer=keras.optimizers.SGD())
  return checkpointer.restore_latest()


def _advance(model, steps):
  for states in seed_states.by_layer_name(model).values():
    for state in states:
      state.assign(state.numpy() + np.array([0, steps], state.dtype))


def test_the_states_restore_by_layer_name_into_another_layout(
    tmp_path, cpu_devices, caplog):
  """A pipeline's checkpoint gives a staged model its states; a hybrid's
  two data copies give a layout of one copy the first copy's, said."""
  saved = _model("pipelined", cpu_devices)
  _advance(saved, 7)
  _saved(saved, tmp_path)
  other = _model("staged", cpu_devices)
  assert _restore(other, tmp_path) == 1
  assert _states(other) == _states(saved)
  two = _model("hybrid", cpu_devices)
  _advance(two, 3)
  path = tf.train.Checkpoint(**{seed_states.KEY: seed_states.SeedStates(
      two)}).write(str(tmp_path / "copies"))
  caplog.set_level("INFO")
  tf.train.Checkpoint(**{seed_states.KEY: seed_states.SeedStates(
      other)}).read(path).assert_existing_objects_matched()
  assert _states(other) == {n: s[:1] for n, s in _states(two).items()}
  assert ("Seed states of layer 'drop': the checkpoint holds 2, this layout "
          "1" in caplog.text)


def test_a_checkpoint_without_seed_states_restores_and_says_so(
    tmp_path, cpu_devices, caplog):
  """A checkpoint of an older tfmgpu (no seed states) still restores, every
  object matched; the states are left as they are."""
  model = _unsplit()
  optimizer = keras.optimizers.SGD()
  optimizer.build(model.trainable_variables)
  old = tf.train.Checkpoint(  # What tfmgpu wrote before.
      model=model, optimizer=optimizer,
      epoch=tf.Variable(1, dtype=tf.int64),
      epoch_step=tf.Variable(0, dtype=tf.int64),
      step=tf.Variable(4, dtype=tf.int64))
  old.save_counter.assign_add(1)
  os.makedirs(tmp_path / "checkpoints")
  old.write(str(tmp_path / "checkpoints" / "ckpt-1"))
  _advance(model, 3)
  before = _states(model)
  caplog.set_level("INFO")
  checkpointer = checkpoints.Checkpointer(
      str(tmp_path), tf.distribute.get_strategy(), model=model,
      optimizer=optimizer)
  assert checkpointer.restore_latest() == 1
  assert _states(model) == before
  assert "holds no seed state of layers drop, drop2" in caplog.text
  path = checkpointer.save(2, step=8)  # The next save holds them.
  assert seed_states.held_in(
      tf.train.load_checkpoint(path).get_variable_to_shape_map()) == {
          "drop", "drop2"}


class _Block(keras.layers.Layer):
  """A block whose Dropout has the same name in every block (keras_hub's
  `self_attention_dropout`)."""

  def build(self, input_shape):
    self.dense = keras.layers.Dense(8, name="dense")
    self.drop = keras.layers.Dropout(0.2, name="drop")

  def call(self, x, training=False):
    return self.drop(self.dense(x), training=training)


def test_blocks_with_alike_named_dropouts_keep_their_own_states(
    tmp_path, cpu_devices):
  """Keyed by the layer's name alone, the four `drop`s' states were one
  list whose order follows the models around the blocks: a pipeline's
  checkpoint gave each block of the unsplit model another block's."""
  def unsplit():
    inputs = keras.Input((8,))
    h = inputs
    for i in range(4):
      h = _Block(name=f"block{i}")(h)
    return keras.Model(inputs, h)

  saved = pipeline.PipelinedModel.from_model(
      unsplit(), num_stages=2, micro_batches=2, devices=cpu_devices[:2])
  for i, (key, states) in enumerate(sorted(
      seed_states.by_layer_name(saved).items())):
    assert key == f"block{i}>drop"
    states[0].assign(states[0].numpy() + np.array([0, 10 + i], "uint32"))
  path = tf.train.Checkpoint(**{seed_states.KEY: seed_states.SeedStates(
      saved)}).write(str(tmp_path / "seeds"))
  for other in (unsplit(), staged.StagedModel.from_model(
      unsplit(), num_stages=4, devices=cpu_devices[:4])):
    tf.train.Checkpoint(**{seed_states.KEY: seed_states.SeedStates(
        other)}).read(path).assert_existing_objects_matched()
    assert _states(other) == _states(saved)
