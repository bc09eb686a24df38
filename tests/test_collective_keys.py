"""Several MirroredStrategy objects in one process, each with TF's default
collectives: once tfmgpu shares their keys, each all-reduces as if it were
the first (TF alone fails the second: tensorflow/tensorflow#62790)."""

import keras
import numpy as np
import tensorflow as tf

from tfmgpu.strategies import collective_keys
from tfmgpu.training.loop import Trainer


def _all_reduce(strategy, width):
  """Sum of ones over the replicas, all-reduced and all-gathered in a
  `tf.function`; the first all-reduce's shape is `[width]`."""

  @tf.function
  def run():
    def replica():
      context = tf.distribute.get_replica_context()
      return (context.all_reduce("sum", tf.ones([width])),
              context.all_gather(tf.ones([width]), axis=0))
    return strategy.run(replica)

  total, gathered = run()
  return (strategy.experimental_local_results(total)[0].numpy(),
          strategy.experimental_local_results(gathered)[0].shape)


def test_strategies_of_any_shape_and_size_all_reduce_one_after_another(
    cpu_devices):
  # Unshared, the second fails ("Shape mismatch in the collective instance
  # 100") and the third too ("joining a group with size 3, but that group
  # has size 2").
  for width, replicas in ((5, 2), (7, 2), (3, 3), (9, 2)):
    strategy = tf.distribute.MirroredStrategy(cpu_devices[:replicas])
    assert collective_keys.share(strategy) is True
    total, gathered = _all_reduce(strategy, width)
    np.testing.assert_array_equal(total, np.full(width, replicas))
    assert gathered == (width * replicas,)


def test_one_group_key_per_device_set_and_only_for_one_host_mirrored(
    cpu_devices):
  first, second = (tf.distribute.MirroredStrategy(cpu_devices[:2])
                   for _ in range(2))
  third = tf.distribute.MirroredStrategy(cpu_devices[:3])
  for strategy in (first, second, third):
    collective_keys.share(strategy)
  keys = collective_keys.process_keys()
  groups = len(keys._known_groups)  # pylint: disable=protected-access
  two, three = (keys.get_group_key(_devices(s)) for s in (second, third))
  # share() made both groups: asking for them makes none.
  assert len(keys._known_groups) == groups  # pylint: disable=protected-access
  assert two >= collective_keys.GROUP_KEY_START
  assert keys.get_group_key(_devices(first)) == two != three
  assert collective_keys.share(tf.distribute.get_strategy()) is False
  assert collective_keys.share(
      tf.distribute.OneDeviceStrategy(cpu_devices[0])) is False


def _devices(strategy):
  return [tf.DeviceSpec.from_string(d).to_string()
          for d in strategy.extended.worker_devices]


def _model(width):
  model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(3)])
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


def test_trainers_of_two_models_on_their_own_strategies(cpu_devices):
  """A sweep in one process: each model on a new default MirroredStrategy.
  The Trainer shares the keys; the losses match one device's."""
  rng = np.random.default_rng(0)
  for width in (4, 6):
    x = rng.normal(size=(32, width)).astype(np.float32)
    y = rng.integers(0, 3, size=32)
    losses = []
    for strategy in (tf.distribute.MirroredStrategy(cpu_devices[:2]), None):
      keras.utils.set_random_seed(width)
      with (strategy or tf.distribute.get_strategy()).scope():
        model = _model(width)
      result = Trainer(model, strategy=strategy, verbose=0, optimizer="sgd",
                       learning_rate=0.1).fit(x, y, epochs=2,
                                              global_batch_size=16, seed=0)
      losses.append(result.history["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
