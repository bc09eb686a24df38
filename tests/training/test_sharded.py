"""Variables split in parts as `--variable_shards` splits them, in one process.

A `ParameterServerStrategy` with a partitioner gives each Keras variable a
`ShardedVariable` value; a variable creator makes the same here without a
cluster (the real one: tests/cluster/test_parameter_server_shards.py). The
split model trains to the unsplit one's weights, and its checkpoint is the
unsplit one's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.training import optimizers
from tfmgpu.training import sharded
from tfmgpu.training import slot_order
from tfmgpu.training import step as step_lib

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 16)


def _in_two_parts(next_creator, **kwargs):
  """A variable creator splitting each variable of 2+ rows in two parts
  along its first axis, as `FixedShardsPartitioner(2)` does."""
  initial = kwargs.pop("initial_value")
  initial = tf.convert_to_tensor(initial() if callable(initial) else initial)
  if initial.shape.rank == 0 or initial.shape[0] < 2:
    return next_creator(initial_value=initial, **kwargs)
  half = initial.shape[0] // 2
  return tf.__internal__.distribute.ShardedVariable(
      [next_creator(initial_value=initial[:half], **kwargs),
       next_creator(initial_value=initial[half:], **kwargs)])


def _model(split: bool) -> keras.Model:
  keras.utils.set_random_seed(0)
  scope = (tf.variable_creator_scope(_in_two_parts) if split
           else tf.variable_creator_scope(lambda n, **kw: n(**kw)))
  with scope:
    return keras.Sequential([keras.Input((5,)),
                             keras.layers.Dense(4, activation="relu",
                                                name="hidden"),
                             keras.layers.Dense(3, name="out")])


def test_the_creator_splits_as_parameter_servers_do():
  model = _model(split=True)
  assert [len(_compat.variable_shards(v) or [v]) for v in model.weights] == [
      2, 2, 2, 2]
  assert len(sharded.trainable_parts(model)) == 8
  whole = _model(split=False)
  assert [id(v) for v in sharded.trainable_parts(whole)] == [
      id(v) for v in whole.trainable_variables]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_split_model_trains_to_the_unsplit_weights(name):
  weights = []
  for split in (False, True):
    model = _model(split)
    strategy = tf.distribute.get_strategy()
    optimizer = optimizers.prepare_optimizer(
        name, model, strategy, learning_rate=0.1, clip_norm=None, fused=True)
    step = tf.function(step_lib.make_train_step(model, optimizer,
                                                global_batch_size=16))
    for _ in range(3):
      step(X, Y)
    weights.append(model.get_weights())
  for unsplit, split in zip(*weights):
    np.testing.assert_allclose(split, unsplit, rtol=1e-6, atol=1e-7)


def test_a_split_variable_saves_and_restores_as_a_whole_one(tmp_path):
  split, whole = _model(split=True), _model(split=False)
  assert _compat.make_shards_whole(split.variables) == 4
  assert _compat.make_shards_whole(whole.variables) == 0
  path = tf.train.Checkpoint(model=split).write(str(tmp_path / "split"))
  keys = dict(tf.train.list_variables(path))
  whole_keys = dict(tf.train.list_variables(
      tf.train.Checkpoint(model=whole).write(str(tmp_path / "whole"))))
  assert keys == whole_keys  # Same names, whole shapes.
  # Into a split model, and into an unsplit one.
  for target in (_model(split=True), _model(split=False)):
    _compat.make_shards_whole(target.variables)
    for v in target.weights:
      v.assign(tf.zeros(v.shape))
    tf.train.Checkpoint(model=target).read(path).assert_consumed()
    for a, b in zip(target.get_weights(), split.get_weights()):
      np.testing.assert_array_equal(a, b)
  # `model.save` reads every weight into numpy.
  split.save(tmp_path / "split.keras")
  loaded = keras.models.load_model(tmp_path / "split.keras")
  for a, b in zip(loaded.get_weights(), split.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_the_slot_order_names_each_part_and_refuses_other_parts(tmp_path):
  split = slot_order.order_of(_model(split=True))
  assert [p.split("/", 1)[1] for p in split[:3]] == [
      "hidden/kernel/part_0", "hidden/kernel/part_1", "hidden/bias/part_0"]
  slot_order.write(str(tmp_path), split)
  whole = [p[:-len("/part_0")] for p in split if p.endswith("/part_0")]
  with pytest.raises(slot_order.SlotOrderError,
                     match=r"split otherwise over the parameter servers "
                     r"\('.*kernel': 2 part\(s\) then, 1 now\): "
                     r"--variable_shards changed"):
    slot_order.check(str(tmp_path), whole)
  slot_order.check(str(tmp_path), split)  # The same parts pass.


@pytest.mark.parametrize("optimizer", [
    keras.optimizers.Lamb(0.1), keras.optimizers.SGD(0.1, clipnorm=1.0)])
def test_an_optimizer_reading_whole_variables_is_refused_for_parts(optimizer):
  """Each part is updated alone: Lamb's trust ratio, or clipnorm, would be
  a part's, not the variable's (the split model trained otherwise)."""
  with pytest.raises(ValueError, match=r"into 8 parts \(--variable_shards\)"
                     r".*or --variable_shards=1"):
    optimizers.prepare_optimizer(optimizer, _model(split=True),
                                 tf.distribute.get_strategy(),
                                 learning_rate=None, clip_norm=None, fused=False)
  optimizers.prepare_optimizer(optimizer.from_config(optimizer.get_config()),
                               _model(split=False),
                               tf.distribute.get_strategy(),
                               learning_rate=None, clip_norm=None, fused=False)
