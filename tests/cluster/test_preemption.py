"""SIGTERM during `Trainer.fit`: save at the next step, raise, resume mid-epoch.

In one process (fast): the loop's own SIGTERM handling and step-level
resume, including under a different replica count. The cluster version is
in test_multi_worker.py.
"""

import glob
import os
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import models
from tfmgpu.training import checkpoints
from tfmgpu.training.loop import Trainer

FIT = dict(epochs=3, global_batch_size=32, steps_per_epoch=6)
DIGITS_ROWS = 256  # For the `digits` fixture.


def make_trainer(strategy, **kwargs):
  with strategy.scope():
    model = models.build_model("convnet", input_shape=(28, 28, 1),
                               num_classes=10, seed=0)
  return Trainer(model, strategy=strategy, verbose=0, steps_per_execution=1,
                 **kwargs)


class SigtermAt(keras.callbacks.Callback):
  """Sends this process SIGTERM after global step `step` (1-based)."""

  def __init__(self, step: int, steps_per_epoch: int):
    super().__init__()
    self.step, self.steps_per_epoch, self.epoch = step, steps_per_epoch, 0

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    if self.epoch * self.steps_per_epoch + batch + 1 == self.step:
      # Never kill pytest: the trainer must have installed its handler.
      assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
      os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("input_mode", ["device", "tf_data"])
def test_sigterm_saves_mid_epoch_and_resume_matches_uninterrupted(
    digits, tmp_path, input_mode):
  mirrored = tfmgpu.get_strategy("mirrored", num_replicas=2)
  whole = make_trainer(mirrored, model_dir=str(tmp_path / "whole"),
                       input_mode=input_mode)
  whole.fit(*digits, **FIT)

  run_dir = str(tmp_path / "preempted")
  handler_before = signal.getsignal(signal.SIGTERM)
  first = make_trainer(mirrored, model_dir=run_dir, input_mode=input_mode,
                       callbacks=[SigtermAt(9, FIT["steps_per_epoch"])])
  with pytest.raises(checkpoints.PreemptedError,
                     match=r"SIGTERM reached this process. Saved .*ckpt-2 at "
                     r"global step 9 \(3 of 6 steps into epoch 2\).*exits "
                     r"with code 42") as preempted:
    first.fit(*digits, **FIT)
  assert preempted.value.step == 9
  assert signal.getsignal(signal.SIGTERM) == handler_before  # Restored.
  ckpt = os.path.join(run_dir, "checkpoints", "ckpt-2")
  assert preempted.value.checkpoint == ckpt
  assert [tf.train.load_variable(ckpt, f"{v}/.ATTRIBUTES/VARIABLE_VALUE")
          for v in ("epoch", "epoch_step", "step")] == [1, 3, 9]

  # Resume in a new "process" with 4 replicas instead of 2.
  second = make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=4),
                        model_dir=run_dir, input_mode=input_mode)
  result = second.fit(*digits, **FIT)
  assert (result.initial_epoch, result.initial_step, result.steps) == (1, 9, 9)
  assert int(second.optimizer.iterations.numpy()) == 18
  for a, b in zip(second.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # No number is saved twice (#16): the partial ckpt-2 is kept as saved,
  # epoch 2's end is ckpt-3 and epoch 3's ckpt-4.
  assert sorted(os.path.basename(p) for p in glob.glob(
      os.path.join(run_dir, "checkpoints", "ckpt-*.index"))) == [
          "ckpt-2.index", "ckpt-3.index", "ckpt-4.index"]
  assert [tf.train.load_variable(
      os.path.join(run_dir, "checkpoints", "ckpt-3"),
      f"{v}/.ATTRIBUTES/VARIABLE_VALUE") for v in ("epoch", "epoch_step",
                                                   "step")] == [2, 0, 12]


def test_sigterm_at_an_epoch_end_keeps_that_epochs_checkpoint(digits,
                                                              tmp_path):
  trainer = make_trainer(tfmgpu.get_strategy("one_device"),
                         model_dir=str(tmp_path),
                         callbacks=[SigtermAt(6, FIT["steps_per_epoch"])])
  with pytest.raises(checkpoints.PreemptedError,
                     match=r"Saved .*ckpt-1 at global step 6 \(the end of "
                     r"epoch 1\)"):
    trainer.fit(*digits, **FIT)


def test_resume_mid_epoch_with_fewer_steps_per_epoch_is_refused(digits,
                                                                tmp_path):
  trainer = make_trainer(tfmgpu.get_strategy("one_device"),
                         model_dir=str(tmp_path),
                         callbacks=[SigtermAt(4, FIT["steps_per_epoch"])])
  with pytest.raises(checkpoints.PreemptedError):
    trainer.fit(*digits, **FIT)
  again = make_trainer(tfmgpu.get_strategy("one_device"),
                       model_dir=str(tmp_path))
  with pytest.raises(ValueError, match=r"saved 4 steps into epoch 1, but "
                     r"steps_per_epoch=3\. Resume with the steps_per_epoch"):
    again.fit(*digits, epochs=3, global_batch_size=32, steps_per_epoch=3)


def test_without_model_dir_sigterm_is_not_caught(digits):
  seen = []

  class Probe(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      seen.append(signal.getsignal(signal.SIGTERM))

  before = signal.getsignal(signal.SIGTERM)
  make_trainer(tfmgpu.get_strategy("one_device"), callbacks=[Probe()]).fit(
      *digits, epochs=1, global_batch_size=32, steps_per_epoch=1)
  assert seen == [before]


class _Killed(BaseException):
  """Stands for SIGKILL in the middle of a save."""


def test_a_kill_while_resaving_after_a_preemption_tears_nothing(
    digits, tmp_path, monkeypatch, caplog):
  # Issue 16, item 1: preempted mid-epoch, the resumed run is killed while it
  # writes the end of that epoch; the next run resumes bit-exactly.
  one = tfmgpu.get_strategy("one_device")
  whole = make_trainer(one, model_dir=str(tmp_path / "whole"))
  whole.fit(*digits, **FIT)
  run_dir = str(tmp_path / "run")
  with pytest.raises(checkpoints.PreemptedError, match=r"Saved .*ckpt-2 at "):
    make_trainer(one, model_dir=run_dir, callbacks=[
        SigtermAt(9, FIT["steps_per_epoch"])]).fit(*digits, **FIT)

  def killed_after_write(self, path):  # The new .index half written.
    open(path + ".index", "wb").close()
    raise _Killed(path)

  with monkeypatch.context() as patch:
    patch.setattr(checkpoints.Checkpointer, "_commit", killed_after_write)
    with pytest.raises(_Killed, match=r"ckpt-3$"):
      make_trainer(one, model_dir=run_dir).fit(*digits, **FIT)
  partial = os.path.join(run_dir, "checkpoints", "ckpt-2")
  assert [tf.train.load_variable(partial, f"{v}/.ATTRIBUTES/VARIABLE_VALUE")
          for v in ("epoch", "epoch_step", "step")] == [1, 3, 9]

  third = make_trainer(one, model_dir=run_dir)
  result = third.fit(*digits, **FIT)
  assert (result.initial_epoch, result.initial_step) == (1, 9)
  assert f"Skipping checkpoint {partial[:-1]}3: it does not read" in (
      caplog.text)
  for a, b in zip(third.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert os.path.basename(result.checkpoint) == "ckpt-5"  # 3 is never reused.
