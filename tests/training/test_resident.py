"""Device-resident data: same examples and weights as the tf.data path,
gathered on each replica's own device."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import models
from tfmgpu.parallel import inspection
from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training import resident
from tfmgpu.training.loop import Trainer

BATCH = 32
DIGITS_ROWS = 8 * BATCH  # For the `digits` fixture.


def _strategy(name):
  if name == "default":
    return tf.distribute.get_strategy()
  if name == "one_device":
    return tfmgpu.get_strategy("one_device")
  return tfmgpu.get_strategy("mirrored", num_replicas=int(name[-1]))


def _train(strategy, x, y, input_mode, *, steps_per_execution=3):
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(28, 28, 1),
                               num_classes=10, seed=0)
  trainer = Trainer(model, strategy=strategy, input_mode=input_mode,
                    steps_per_execution=steps_per_execution, verbose=0)
  result = trainer.fit(x, y, epochs=2, global_batch_size=BATCH,
                       steps_per_epoch=7, seed=1)
  return model.get_weights(), result.history["loss"], trainer


@pytest.mark.parametrize("strategy", ["default", "one_device",
                                      "mirrored x2"])  # x4: the same path.
def test_device_data_trains_like_tf_data(digits, strategy):
  ref, ref_loss, _ = _train(_strategy(strategy), *digits, "tf_data")
  got, loss, _ = _train(_strategy(strategy), *digits, "device")
  init = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10,
                            seed=0).get_weights()
  assert max(np.abs(r - w0).max() for r, w0 in zip(ref, init)) > 1e-3
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


def test_epoch_table_matches_the_tf_data_batches(digits):
  """Replica r of step k holds the rows the tf.data pipeline hands it."""
  x, y = digits
  strategy = _strategy("mirrored x2")
  held = resident.DeviceData(strategy, (x, y))
  table = held.epoch(global_batch_size=BATCH, steps=3, seed=5, epoch=1,
                     shuffle=True)
  dataset = inputs.distribute_arrays(
      strategy, (x, y), global_batch_size=BATCH,
      order=inputs.epoch_order(len(x), 5, 1))
  indices = strategy.experimental_local_results(table.index)
  for step, (_, labels) in zip(range(3), dataset):
    for r, got in enumerate(strategy.experimental_local_results(labels)):
      np.testing.assert_array_equal(y[indices[r].numpy()[step]], got.numpy())


def test_each_replica_gathers_on_its_own_device(digits, cpu_devices):
  strategy = _strategy("mirrored x2")
  _, _, trainer = _train(strategy, *digits, "device", steps_per_execution=1)
  fn = trainer._train_fns[(BATCH, feeds.DEVICE)]  # pylint: disable=protected-access
  held = resident.DeviceData(strategy, tuple(digits))
  batches = held.epoch(global_batch_size=BATCH, steps=7, seed=1, epoch=0,
                       shuffle=True).from_step(0)
  ops = inspection.op_placements(
      fn.get_concrete_function(batches, tf.constant(1)))
  gathers = collections.Counter(p.device for p in ops if p.type == "GatherV2")
  assert set(gathers) == set(cpu_devices[:2]), gathers
  assert not any(p.type.startswith("IteratorGetNext") for p in ops)
  for r, local in enumerate(strategy.experimental_local_results(held.data[0])):
    assert tfmgpu.devices.canonical_device(local.device) == cpu_devices[r]


def test_auto_picks_device_data_on_one_host_when_it_fits(digits):
  x, y = digits
  mirrored = _strategy("mirrored x2")
  assert resident.use_device_data("auto", mirrored, (x, y))
  both_copies = 2 * (x.nbytes + y.nbytes)  # The budget counts every replica.
  assert resident.use_device_data("auto", mirrored, (x, y),
                                  max_bytes=both_copies)
  assert not resident.use_device_data("auto", mirrored, (x, y),
                                      max_bytes=both_copies - 1)
  assert not resident.use_device_data("tf_data", mirrored, (x, y))
  central = tf.distribute.experimental.CentralStorageStrategy()
  assert not resident.use_device_data("auto", central, (x, y))


def test_input_mode_errors_name_the_argument():
  with pytest.raises(ValueError, match="input_mode='disk' is unknown.*auto"):
    resident.check_input_mode("disk", tf.distribute.get_strategy())
  central = tf.distribute.experimental.CentralStorageStrategy()
  with pytest.raises(ValueError, match="input_mode='device' needs a one-host "
                     "strategy.*CentralStorageStrategy"):
    resident.check_input_mode("device", central)


def test_epoch_needs_enough_examples(digits):
  held = resident.DeviceData(_strategy("one_device"), tuple(digits))
  with pytest.raises(ValueError, match="steps=9 of global_batch_size=32"):
    held.epoch(global_batch_size=BATCH, steps=9, seed=0, epoch=0,
               shuffle=False)
