"""Issue 16 in the Trainer: the run directory's lock, the learning rate given
on resume, checkpoints by steps and by time (a kill mid-epoch resumes
bit-exactly), a full disk while saving, the NaN message with a model_dir."""

import errno
import glob
import json
import logging
import os
import re
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import data
from tfmgpu import models
from tfmgpu import rundir
from tfmgpu import runs
from tfmgpu.config import TrainConfig
from tfmgpu.training import checkpoints
from tfmgpu.training import controller as controller_lib
from tfmgpu.training.loop import NonFiniteLossError, Trainer

DIGITS_ROWS = 256  # For the `digits` fixture.
FIT = dict(epochs=2, global_batch_size=32, steps_per_epoch=6)


def make_trainer(model_dir=None, model="mlp", **kwargs):
  strategy = tfmgpu.get_strategy("one_device")
  with strategy.scope():
    model = models.build_model(model, input_shape=(28, 28, 1),
                               num_classes=10, seed=0)
  kwargs.setdefault("steps_per_execution", 1)
  kwargs.setdefault("verbose", 0)
  return Trainer(model, strategy=strategy,
                 model_dir=str(model_dir) if model_dir else None, **kwargs)


def _numbers(model_dir):
  return sorted(int(os.path.basename(p)[len("ckpt-"):-len(".index")])
                for p in glob.glob(os.path.join(model_dir, "checkpoints",
                                                "ckpt-*.index")))


def _position(path):
  return [tf.train.load_variable(path, f"{v}/.ATTRIBUTES/VARIABLE_VALUE")
          for v in ("epoch", "epoch_step", "step")]


class _Killed(BaseException):
  """Stands for SIGKILL: nothing after it runs, not even `except Exception`."""


class KillAt(keras.callbacks.Callback):
  """Raises `_Killed` after global step `step` (1-based)."""

  def __init__(self, step, steps_per_epoch):
    super().__init__()
    self.step, self.steps_per_epoch, self.epoch = step, steps_per_epoch, 0

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    if self.epoch * self.steps_per_epoch + batch + 1 == self.step:
      raise _Killed(self.step)


# ---------------------------------------------------------------- lock


def test_fit_holds_the_run_dir_lock_and_releases_it(digits, tmp_path):
  seen = []

  class Probe(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      seen.append(json.loads((tmp_path / rundir.LOCK_NAME).read_text())["pid"])

  make_trainer(tmp_path, callbacks=[Probe()]).fit(*digits, epochs=1,
                                                  global_batch_size=32,
                                                  steps_per_epoch=2)
  assert seen == [os.getpid()] * 2
  assert not (tmp_path / rundir.LOCK_NAME).exists()


def test_a_model_dir_deleted_mid_run_is_locked_again_at_the_next_save(
    digits, tmp_path):
  """`rmtree(model_dir)` at step 1: the epoch's checkpoint recreated the
  directory without run.lock and run.json, silently (fault trial n)."""
  import shutil  # pylint: disable=g-import-not-at-top
  model_dir = tmp_path / "run"
  seen = []

  class DeleteAtStep1(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if not seen:
        shutil.rmtree(model_dir)
        seen.append("deleted")

    def on_epoch_end(self, epoch, logs=None):  # After its checkpoint.
      seen.append(sorted(os.listdir(model_dir)))

  lock = rundir.open_run(str(model_dir), {"model": "mlp"})  # As the CLI.
  try:
    make_trainer(model_dir, callbacks=[DeleteAtStep1()]).fit(
        *digits, epochs=1, global_batch_size=32, steps_per_epoch=2)
  finally:
    lock.release()
  assert seen == ["deleted", ["checkpoints", "run.json", "run.lock"]]
  assert json.loads((model_dir / rundir.RECORD_NAME).read_text())[
      "model"] == "mlp"


def test_a_deleted_model_dir_taken_by_another_run_gets_no_checkpoint(
    digits, tmp_path):
  """Deleted mid-run, then taken by a second run: the save wrote this run's
  ckpt-1 among that run's checkpoints with only a warning (at each save),
  and the release at the end deleted that run's run.lock (review r3)."""
  import fcntl  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  model_dir, other = tmp_path / "run", []

  class OtherRunTakesItAtStep1(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if not other:
        shutil.rmtree(model_dir)
        os.makedirs(model_dir / "checkpoints")
        other.append(os.open(model_dir / rundir.LOCK_NAME,
                             os.O_RDWR | os.O_CREAT))
        fcntl.flock(other[0], fcntl.LOCK_EX | fcntl.LOCK_NB)  # Its flock.
        os.write(other[0], json.dumps({"pid": 4242, "host": "h"}).encode())

  lock = rundir.open_run(str(model_dir), {"model": "mlp"})  # As the CLI.
  try:
    with pytest.raises(rundir.RunDirLockedError, match=(
        r"'.*run' was deleted while this run trained in it, and another run "
        r"has taken it since: PID 4242 on host h.*This run's checkpoint is "
        "not saved there")):
      make_trainer(model_dir, callbacks=[OtherRunTakesItAtStep1()]).fit(
          *digits, epochs=1, global_batch_size=32, steps_per_epoch=2)
  finally:
    lock.release()
    os.close(other[0])
  assert os.listdir(model_dir / "checkpoints") == []
  assert json.loads((model_dir / rundir.LOCK_NAME).read_text())["pid"] == 4242


def test_the_lock_is_released_after_a_preemption(digits, tmp_path):
  class SigtermAt2(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if batch == 1:
        os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(checkpoints.PreemptedError):
    make_trainer(tmp_path, callbacks=[SigtermAt2()]).fit(*digits, **FIT)
  assert not (tmp_path / rundir.LOCK_NAME).exists()
  rundir.RunLock(str(tmp_path)).acquire().release()  # Free for the rerun.


def test_a_sigterm_in_the_last_steps_stops_with_the_save_it_announced(
    digits, tmp_path, caplog):
  """Issue 29 item 5: SIGTERM after the last step's boundary check logged
  "saving a checkpoint ..., then stopping" and then finished (exit 0)."""
  class SigtermAtTheLastStep(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
      if (self.epoch, batch) == (FIT["epochs"] - 1, FIT["steps_per_epoch"] - 1):
        os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(checkpoints.PreemptedError, match=(
      r"Saved .*ckpt-2 at global step 12 \(the end of epoch 2\)\. Run the "
      r"same command again to finish: training is done")):
    make_trainer(tmp_path, callbacks=[SigtermAtTheLastStep()]).fit(
        *digits, **FIT)
  assert "then stopping" in caplog.text
  result = make_trainer(tmp_path).fit(*digits, **FIT)  # The rerun finishes.
  assert (result.initial_epoch, result.steps) == (2, 0)


# ------------------------------------------------------- learning rate


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_learning_rate_given_on_resume_wins(digits, tmp_path, caplog,
                                                optimizer):
  caplog.set_level(logging.INFO)
  make_trainer(tmp_path, optimizer=optimizer, learning_rate=1e-2).fit(
      *digits, epochs=1, global_batch_size=32, steps_per_epoch=3)
  resumed = make_trainer(tmp_path, optimizer=optimizer, learning_rate=1e-9)
  result = resumed.fit(*digits, epochs=2, global_batch_size=32,
                       steps_per_epoch=3)
  assert result.initial_epoch == 1
  assert float(resumed.optimizer.learning_rate) == np.float32(1e-9)
  assert re.search(r"learning_rate: .*ckpt-1 holds 0\.01; training with the "
                   r"1e-09 given to this run\.", caplog.text)
  # The optimizer state other than the rate was restored: its step count.
  assert int(resumed.optimizer.iterations.numpy()) == 6
  saved = os.path.join(str(tmp_path), "checkpoints", "ckpt-2")
  assert tf.train.load_variable(
      saved, "optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE") == (
          np.float32(1e-9))


class _TenthEachEpoch(keras.callbacks.Callback):
  """Lowers the learning rate at each epoch's end, as ReduceLROnPlateau
  does when the loss stalls."""

  def on_epoch_end(self, epoch, logs=None):
    rate = self.model.optimizer.learning_rate
    rate.assign(rate * 0.1)


def test_a_rate_callbacks_lowered_resumes_lowered(digits, tmp_path):
  """A trial: the checkpoint holds the rate before the callbacks ran, and
  a restore put back the rate given; the resumed epochs trained at 1e-2
  where the run, not stopped, went on at 1e-4 (6.8e-2 off, silently).
  A second fit in the same process keeps it too, and a new rate wins."""
  fit = dict(global_batch_size=32, steps_per_epoch=3)
  whole = make_trainer(tmp_path / "whole", learning_rate=1e-2,
                       callbacks=[_TenthEachEpoch()])
  whole.fit(*digits, epochs=4, **fit)
  first = make_trainer(tmp_path / "stopped", learning_rate=1e-2,
                       callbacks=[_TenthEachEpoch()])
  first.fit(*digits, epochs=1, **fit)
  first.fit(*digits, epochs=2, **fit)  # Resumed in the process.
  assert float(first.optimizer.learning_rate) == pytest.approx(1e-4)
  resumed = make_trainer(tmp_path / "stopped", learning_rate=1e-2,
                         callbacks=[_TenthEachEpoch()])
  assert resumed.fit(*digits, epochs=4, **fit).initial_epoch == 2
  assert float(resumed.optimizer.learning_rate) == pytest.approx(1e-6)
  for got, want in zip(resumed.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_array_equal(got, want)
  again = make_trainer(tmp_path / "stopped", learning_rate=5e-3)
  again.fit(*digits, epochs=5, **fit)
  assert float(again.optimizer.learning_rate) == np.float32(5e-3)


def test_weights_a_callback_swaps_in_for_a_moment_are_not_saved(digits,
                                                                tmp_path):
  """The review: with the checkpoint written after the callbacks, Keras'
  SwapEMAWeights(swap_on_epoch=True) left the moving averages in it, and
  the resumed run trained from them (2.6e-3 off, silently)."""
  fit = dict(global_batch_size=32, steps_per_epoch=3)

  def trainer(name):
    return make_trainer(
        tmp_path / name, optimizer=keras.optimizers.SGD(0.1, use_ema=True),
        callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)])

  whole = trainer("whole")
  whole.fit(*digits, epochs=3, **fit)
  trainer("stopped").fit(*digits, epochs=1, **fit)
  resumed = trainer("stopped")
  resumed.fit(*digits, epochs=3, **fit)
  for got, want in zip(resumed.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-7)


# ------------------------------------------------ periodic checkpoints


def test_checkpoint_every_steps_saves_mid_epoch_and_a_kill_resumes_exactly(
    digits, tmp_path):
  whole = make_trainer(tmp_path / "whole")
  whole.fit(*digits, **FIT)

  run_dir = tmp_path / "run"
  with pytest.raises(_Killed):
    make_trainer(run_dir, checkpoint_every_steps=4,
                 callbacks=[KillAt(9, FIT["steps_per_epoch"])]).fit(
                     *digits, **FIT)
  # Step 4 (epoch 1), the end of epoch 1 (step 6) and step 8 (epoch 2).
  assert _numbers(run_dir) == [1, 2, 3]
  assert [_position(str(run_dir / "checkpoints" / f"ckpt-{n}"))
          for n in (1, 2, 3)] == [[0, 4, 4], [1, 0, 6], [1, 2, 8]]

  resumed = make_trainer(run_dir, checkpoint_every_steps=4)
  result = resumed.fit(*digits, **FIT)
  assert (result.initial_epoch, result.initial_step, result.steps) == (1, 8, 4)
  for a, b in zip(resumed.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_array_equal(a, b)


class _Scheduled:
  """A stand-in for `ClusterCoordinator`: each scheduled call's result."""

  def __init__(self):
    self.joins = []  # The steps of each call scheduled, per join.
    self._calls = []

  def schedule(self, fn, args):
    del fn
    n = int(args[1])
    self._calls.append(n)
    out = dict(loss=np.float32(n), count=np.float32(n),
               loss_rows=np.float32(n), non_finite=np.float32(0))
    return type("Result", (), {"fetch": lambda self: out})()

  def join(self):
    self.joins.append(self._calls)
    self._calls = []


def test_checkpoint_every_steps_is_kept_under_parameter_servers(tmp_path):
  """The coordinator joined 4 calls per worker (80 steps with 2 workers and
  steps_per_execution=10) and saves fall only between joins: a 40-step
  epoch asked to save every 5 steps saved none mid-epoch. A join now ends
  at the call reaching the next multiple, as a one-device run saves, its
  steps split so that both workers run one call."""
  from tfmgpu.training import coordinator  # pylint: disable=import-outside-toplevel
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  optimizer = keras.optimizers.SGD()
  optimizer.build(model.trainable_variables)
  scheduled = _Scheduled()
  runner = coordinator.CoordinatorRunner(
      scheduled, None, None, steps_per_execution=10,
      calls_per_join=coordinator.CALLS_PER_WORKER_PER_JOIN * 2, workers=2)
  ckpt = checkpoints.Checkpointer(str(tmp_path), tf.distribute.get_strategy(),
                                  model=model, optimizer=optimizer,
                                  max_to_keep=10)
  controller_lib.Controller(runner, controller_lib.LoopOptions(
      model=model, verbose=0, checkpointer=ckpt, checkpoint_every_steps=5,
      summary_writer=tf.summary.create_noop_writer())).run(
          epochs=1, steps_per_epoch=40)
  assert scheduled.joins == [[5, 5]] * 4
  assert [_position(str(tmp_path / "checkpoints" / f"ckpt-{n}"))
          for n in _numbers(tmp_path)] == [
              [0, 10, 10], [0, 20, 20], [0, 30, 30], [1, 0, 40]]


def test_a_resumed_epoch_reports_the_loss_and_metrics_of_all_its_steps(
    digits, tmp_path, capsys):
  """The epoch resumed at step 2 reported the mean of its steps 3..6 only
  (2.2770 / 0.164 against 2.2397 / 0.148 in the trial): the mid-epoch
  checkpoint now holds the epoch's running sums. Its progress line says
  it was resumed (its time counts only the steps run since)."""
  whole = make_trainer(tmp_path / "whole").fit(*digits, **FIT)
  run_dir = tmp_path / "run"
  with pytest.raises(_Killed):
    make_trainer(run_dir, checkpoint_every_steps=4,
                 callbacks=[KillAt(9, FIT["steps_per_epoch"])]).fit(
                     *digits, **FIT)
  capsys.readouterr()
  result = make_trainer(run_dir, verbose=1).fit(*digits, **FIT)
  assert (result.initial_epoch, result.initial_step) == (1, 8)
  assert "Epoch 2/2 (resumed after step 2): 6/6 - " in capsys.readouterr().out
  assert result.history["loss"] == whole.history["loss"][1:]
  assert result.history["accuracy"] == whole.history["accuracy"][1:]


def test_a_callback_stopping_mid_epoch_saves_where_it_stopped(
    digits, tmp_path, caplog):
  """A callback's `stop_training` after step 2 of epoch 2 saved the
  checkpoint as the end of epoch 2: the rerun skipped the rest of it (20
  steps instead of 24 in the trial, weights 0.046 off)."""
  whole = make_trainer(tmp_path / "whole")
  whole.fit(*digits, **FIT)

  run_dir = tmp_path / "run"
  stopped = make_trainer(run_dir, callbacks=[_StopAfter(8)])
  caplog.set_level("INFO")
  result = stopped.fit(*digits, **FIT)
  assert result.steps == 8
  assert "A callback stopped training in epoch 2, after step 2 of 6; a " \
         "rerun resumes there." in caplog.text
  assert _position(str(run_dir / "checkpoints" / "ckpt-2")) == [1, 2, 8]
  resumed = make_trainer(run_dir)
  result = resumed.fit(*digits, **FIT)
  assert (result.initial_epoch, result.initial_step, result.steps) == (1, 8, 4)
  for a, b in zip(resumed.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_array_equal(a, b)


class _StopAfter(keras.callbacks.Callback):
  """Sets `model.stop_training` after global step `step` (1-based)."""

  def __init__(self, step):
    super().__init__()
    self.step, self.done = step, 0

  def on_train_batch_end(self, batch, logs=None):
    self.done += 1
    if self.done == self.step:
      self.model.stop_training = True


def test_checkpoint_every_s_saves_on_the_clock(digits, tmp_path, monkeypatch):
  now = [0.0]

  def clock():  # Every reading is 10 s later: no real time is measured.
    now[0] += 10.0
    return now[0]

  monkeypatch.setattr(controller_lib.time, "monotonic", clock)
  trainer = make_trainer(tmp_path, checkpoint_every_s=25.0)
  trainer.fit(*digits, epochs=1, global_batch_size=32, steps_per_epoch=6)
  # Read when training starts (20 s) and after each step (30, 40, 50 s:
  # 30 s since the start, a save, read again at 60 s; then 70, 80 s): one
  # save after step 3, then the end of the epoch.
  positions = [_position(str(tmp_path / "checkpoints" / f"ckpt-{n}"))
               for n in _numbers(tmp_path)]
  assert positions == [[0, 3, 3], [1, 0, 6]]


# ---------------------------------------------------------- disk full


def test_a_full_disk_while_saving_names_the_directory_and_keeps_the_rest(
    digits, tmp_path, monkeypatch):
  trainer = make_trainer(tmp_path)
  trainer.fit(*digits, epochs=1, global_batch_size=32, steps_per_epoch=2)
  real_write = tf.train.Checkpoint.write

  def disk_full(self, prefix, *args, **kwargs):
    with open(prefix + ".data-00000-of-00001", "wb") as f:
      f.write(b"partial")
    raise tf.errors.ResourceExhaustedError(None, None, "")

  monkeypatch.setattr(tf.train.Checkpoint, "write", disk_full)
  with pytest.raises(OSError) as full:
    trainer.fit(*digits, epochs=2, global_batch_size=32, steps_per_epoch=2)
  assert full.value.errno == errno.ENOSPC
  assert full.value.filename == str(tmp_path / "checkpoints")
  assert "ckpt-2 was not saved, the checkpoints before it are intact" in (
      str(full.value))
  assert _numbers(tmp_path) == [1]
  assert not glob.glob(str(tmp_path / "checkpoints" / "ckpt-2*"))  # Freed.
  # A file-size limit (ulimit -f) or a quota: TF says so in words only (a
  # raw OutOfRangeError 'File too large' traceback before).
  for error, code in ((tf.errors.OutOfRangeError, errno.EFBIG),
                      (tf.errors.UnknownError, errno.EDQUOT)):
    def limited(self, prefix, *args, error=error, code=code, **kwargs):
      raise error(None, None, f"{prefix}_temp/part; {os.strerror(code)}")
    monkeypatch.setattr(tf.train.Checkpoint, "write", limited)
    with pytest.raises(OSError) as full:
      trainer.checkpointer.save(2)
    assert (full.value.errno, full.value.filename) == (
        code, str(tmp_path / "checkpoints"))
    assert re.fullmatch(rf"{os.strerror(code)}; ckpt-\d+ was not saved, "
                        "the checkpoints before it are intact",
                        full.value.strerror)
  monkeypatch.setattr(tf.train.Checkpoint, "write", real_write)
  assert make_trainer(tmp_path).checkpointer.restore_latest() == 1


# -------------------------------------------------------- NaN message


def test_the_nan_message_names_the_checkpoint_state_of_a_model_dir(
    digits, tmp_path):
  x, y = digits
  with pytest.raises(NonFiniteLossError) as first:
    make_trainer(tmp_path).fit(np.full_like(x, np.nan), y, **FIT)
  assert "the last good checkpoint is none yet" in str(first.value)
  assert "no model_dir" not in str(first.value)
  with pytest.raises(NonFiniteLossError, match=r"none \(no model_dir\)"):
    make_trainer().fit(np.full_like(x, np.nan), y, **FIT)


def test_an_inf_batchnorm_statistic_stops_training_naming_it(tmp_path):
  """A row of 1e30 made BatchNorm's moving_variance inf with finite
  weights and loss: training finished and the checkpoints and the model
  kept it. Non-trainable weights are checked too now."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  x[5] = 1e30
  y = rng.integers(0, 3, 64)
  keras.utils.set_random_seed(1)
  inputs = keras.Input((8,))
  hidden = keras.layers.BatchNormalization(name="bn")(
      keras.layers.Dense(8, activation="relu", name="d1")(inputs))
  model = keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden))
  trainer = Trainer(model, verbose=0, steps_per_execution=1,
                    model_dir=str(tmp_path))
  with pytest.raises(NonFiniteLossError,
                     match=r"NaN/inf weights: bn/moving_variance\) at step 1 "):
    trainer.fit(x, y, epochs=1, global_batch_size=16, shuffle=False)


class _MaskedLogits(keras.layers.Layer):
  """Adds a fixed mask to the logits: class 2 is never predicted (-inf)."""

  def build(self, input_shape):
    self.mask = self.add_weight(
        shape=(3,), trainable=False, name="mask",
        initializer=keras.initializers.Constant([0.0, 0.0, -np.inf]))

  def call(self, logits):
    return logits + self.mask


def test_a_weight_non_finite_by_design_does_not_stop_training():
  """A -inf mask kept as a weight is not a diverged model: only weights
  finite when the step was traced are checked (it stopped at step 1)."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 2, 32)
  inputs = keras.Input((4,))
  model = keras.Model(inputs, _MaskedLogits(name="masked")(
      keras.layers.Dense(3)(inputs)))
  result = Trainer(model, verbose=0, steps_per_execution=1).fit(
      x, y, epochs=1, global_batch_size=8, shuffle=False)
  assert np.isfinite(result.history["loss"][0])


# ---------------------------------------------------------- bad labels


def test_a_label_outside_the_class_range_is_refused_before_training(
    digits, tmp_path):
  x, y = digits
  y = y.copy()
  y[17] = 10
  arrays = data.Arrays("mine", x, y, x[:8], y[:8] % 10, num_classes=10)
  with pytest.raises(ValueError, match=(
      r"dataset 'mine': y_train\[17\]=10 is outside the class range 0\.\.9 "
      r"\(1 label\(s\) out of range\)\. Labels must be integer class indices")):
    runs.run_training(TrainConfig(strategy="one_device", model="mlp",
                                  model_dir=str(tmp_path)), arrays=arrays)
  assert not os.path.exists(tmp_path / "checkpoints")  # Nothing started.


# ----------------------------------------------- resume under a new layout


def _pipelined_trainer(model_dir, micro_batches, devices, **kwargs):
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  model = pipeline.PipelinedModel.from_model(
      models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10,
                         seed=0),
      num_stages=2, micro_batches=micro_batches, devices=devices[:2])
  return Trainer(model, strategy=tf.distribute.get_strategy(), verbose=0,
                 steps_per_execution=1, model_dir=str(model_dir), **kwargs)


def test_a_pipeline_resumed_with_other_micro_batches_ends_as_uninterrupted(
    digits, tmp_path, cpu_devices):
  """Issue 29 item 4: saved mid-epoch at micro_batches=4, resumed at 2.

  The resumed run ends where both uninterrupted runs do, to float rounding
  (a new layout sums the gradient in a new order). On the convnet over
  exact-zero backgrounds any 1e-8 change (this one, or a relative noise of
  1e-8 on the weights of an uninterrupted run at step 12) can later flip a ReLU or
  max-pool winner that Adam turns into a full step: there the runs part by
  1e-3..1e-1 after 5 epochs however the change came (docs/reliability.md).
  """
  ends = [_pipelined_trainer(tmp_path / f"whole{m}", m, cpu_devices)
          for m in (4, 2)]
  for trainer in ends:
    trainer.fit(*digits, **FIT)
  run_dir = tmp_path / "run"
  with pytest.raises(_Killed):
    _pipelined_trainer(run_dir, 4, cpu_devices, checkpoint_every_steps=4,
                       callbacks=[KillAt(9, FIT["steps_per_epoch"])]).fit(
                           *digits, **FIT)
  resumed = _pipelined_trainer(run_dir, 2, cpu_devices)
  result = resumed.fit(*digits, **FIT)
  assert (result.initial_epoch, result.initial_step, result.steps) == (1, 8, 4)
  for whole in ends:
    for a, b in zip(resumed.model.get_weights(), whole.model.get_weights()):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
