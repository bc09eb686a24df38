"""Data x pipeline x tensor, 2 x 2 x 2 on 8 logical CPUs: `gpt` tiny (4
heads) trains equal to the unsplit model, every shard on the device the
layout names; its checkpoint restores unsplit with the same weights and as
T=4 with the same predictions. `GPT2CausalLM` (keras_hub) trains through
Keras `fit` equal to one device, and its `predict` equals the unsplit
model's.

The suite's process has 4 logical CPUs, so these tests skip there;
`test_3d_process.test_2x2x2_on_eight_devices` runs this file in a process of
its own with 8 (`TFMGPU_TEST_DEVICES=8`).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.parallel import hybrid
from tfmgpu.parallel import tensor
from tfmgpu.training import portable

import test_gpt_parallel as gp  # pylint: disable=g-bad-import-order
import test_hybrid as th  # pylint: disable=g-bad-import-order

pytestmark = pytest.mark.skipif(
    len(tfmgpu.list_devices("CPU")) < 8,
    reason="needs 8 logical CPUs: run by test_hybrid in a process of its own")

LAYOUT = hybrid.Layout(data=2, stages=2, tensor=2, micro_batches=2)


@pytest.fixture(scope="module")
def data():
  """The `gpt` tokens and targets of `test_gpt_parallel` (3 steps)."""
  return gp._data()  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
  """`(layout, losses, step, checkpoint)`: the 2x2x2 layout after 3 Adam
  steps of its own step, and the checkpoint tfmgpu's `Checkpointer` (what
  the Trainer saves with) wrote of it. One training serves the parity and
  the checkpoint tests (each took one of its own)."""
  from tfmgpu.training import checkpoints  # pylint: disable=g-import-not-at-top
  model = hybrid.build_layout(th._gpt4(), LAYOUT,  # pylint: disable=protected-access
                              devices=tfmgpu.list_devices("CPU"))
  optimizer = gp.OPTIMIZERS["adam"][0]()
  losses, step = th._train(model, *data, lambda: optimizer)  # pylint: disable=protected-access
  saver = checkpoints.Checkpointer(
      str(tmp_path_factory.mktemp("run_2x2x2")), tf.distribute.get_strategy(),
      model=model, optimizer=optimizer)
  return model, losses, step, saver.save(epoch=1, step=gp.STEPS)


def test_2x2x2_trains_as_unsplit_on_the_mesh(data, cpu_devices, trained):
  """Adam, by the layout's own step (SGD on this mesh: the keras_hub case
  below, through Keras fit)."""
  model, losses, step, _ = trained
  make, tol = gp.OPTIMIZERS["adam"]
  assert sorted(model.devices) == sorted(cpu_devices[:8])
  want = th._unsplit_train(*data, make, build=th._gpt4)  # pylint: disable=protected-access
  th._assert_same((losses, model.to_unsplit().get_weights()), want, tol,  # pylint: disable=protected-access
                  build=th._gpt4)  # pylint: disable=protected-access
  th.assert_shards_on_the_mesh(model, LAYOUT, cpu_devices, step)


def test_2x2x2_checkpoint_restores_unsplit_and_as_t4(data, cpu_devices,
                                                     trained):
  """(`predict` through the layout itself: the keras_hub case below.)"""
  x, _ = data
  model, _, _, path = trained
  whole = model.to_unsplit()
  expected = whole.predict(x, verbose=0)
  assert portable.has_view(path)
  unsplit = portable.restore_weights(th._gpt4(seed=3), path)  # pylint: disable=protected-access
  for got, want in zip(unsplit.get_weights(), whole.get_weights(),
                       strict=True):  # The same model: its predictions too.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  t4 = tensor.TensorParallelModel(th._gpt4(seed=3), cpu_devices[4:8])  # pylint: disable=protected-access
  portable.restore_weights(t4, path)
  np.testing.assert_allclose(t4.predict(x, batch_size=gp.BATCH, verbose=0),
                             expected, rtol=1e-5, atol=1e-5)


def test_a_keras_hub_causal_lm_trains_2x2x2_as_one_device_keras(
    cpu_devices):
  """GPT2CausalLM: cut between its blocks (the tied embedding on both
  stages), its attention and MLP kernels split by keras_hub path rules."""
  pytest.importorskip("keras_hub")
  import test_hub_models as hub  # pylint: disable=g-import-not-at-top
  predicted, diff = hub.matrix.run_case("gpt2", "2x2x2", cpu_devices)
  assert predicted <= 1e-5 and diff <= 1e-5
