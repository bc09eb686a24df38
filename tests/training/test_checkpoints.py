"""`Checkpointer`: checkpoint numbers, the saved position, restore, latest."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.training import checkpoints


def _model_and_optimizer(seed):
  """A tiny model and an SGD optimizer that has taken `seed` steps."""
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.set_weights([np.full((3, 2), seed, np.float32),
                     np.full((2,), -seed, np.float32)])
  optimizer = keras.optimizers.SGD(learning_rate=0.1)
  optimizer.build(model.trainable_variables)
  optimizer.iterations.assign(seed)
  return model, optimizer


def _checkpointer(model_dir, seed=0):
  model, optimizer = _model_and_optimizer(seed)
  return checkpoints.Checkpointer(str(model_dir), tf.distribute.get_strategy(),
                                  model=model, optimizer=optimizer)


def _saved_numbers(model_dir):
  return sorted(int(os.path.basename(p)[len("ckpt-"):-len(".index")])
                for p in glob.glob(os.path.join(model_dir, "checkpoints",
                                                "ckpt-*.index")))


def test_checkpoint_n_belongs_to_epoch_n(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  assert saver.chief
  assert saver.latest is None
  assert saver.save(1, step=3) == str(tmp_path / "checkpoints" / "ckpt-1")
  # Preempted 2 steps into epoch 3: the file is that epoch's, ckpt-3.
  assert saver.save(2, step=8, epoch_step=2) == str(
      tmp_path / "checkpoints" / "ckpt-3")
  assert saver.latest == str(tmp_path / "checkpoints" / "ckpt-3")
  assert _saved_numbers(tmp_path) == [1, 3]


def test_only_the_newest_max_to_keep_are_kept(tmp_path):
  saver = _checkpointer(tmp_path)
  for epoch in range(1, 6):
    saver.save(epoch, step=epoch * 4)
  assert _saved_numbers(tmp_path) == [3, 4, 5]


def test_restore_latest_returns_the_epoch_and_the_position(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  saver.save(1, step=3)
  saver.save(2, step=8, epoch_step=2)

  fresh = _checkpointer(tmp_path, seed=7)
  assert fresh.progress == checkpoints.Progress(0, 0, 0)
  assert fresh.restore_latest() == 2
  assert fresh.progress == checkpoints.Progress(epoch=2, epoch_step=2, step=8)
  assert fresh.latest == saver.latest
  restored, saved = fresh.checkpoint, saver.checkpoint
  for got, want in zip(restored.model.get_weights(),
                       saved.model.get_weights()):
    np.testing.assert_array_equal(got, want)
  assert int(restored.optimizer.iterations.numpy()) == 1


def test_save_keeps_the_last_step_unless_given(tmp_path):
  saver = _checkpointer(tmp_path)
  saver.save(1, step=5)
  saver.save(2)
  fresh = _checkpointer(tmp_path)
  assert fresh.restore_latest() == 2
  assert fresh.progress == checkpoints.Progress(epoch=2, epoch_step=0, step=5)
  # A resumed run saves its next epoch over no existing number.
  assert fresh.save(3, step=9) == str(tmp_path / "checkpoints" / "ckpt-3")
  assert _saved_numbers(tmp_path) == [1, 2, 3]


def test_nothing_to_restore_is_epoch_0(tmp_path):
  saver = _checkpointer(tmp_path)
  assert saver.restore_latest() == 0
  assert saver.progress == checkpoints.Progress()
  assert saver.latest is None


@pytest.mark.parametrize("epoch_step,number", [(0, 4), (1, 5)])
def test_progress_round_trips_through_the_files(tmp_path, epoch_step, number):
  saver = _checkpointer(tmp_path)
  path = saver.save(4, step=17, epoch_step=epoch_step)
  assert os.path.basename(path) == f"ckpt-{number}"
  assert [tf.train.load_variable(path, f"{v}/.ATTRIBUTES/VARIABLE_VALUE")
          for v in ("epoch", "epoch_step", "step")] == [4, epoch_step, 17]
