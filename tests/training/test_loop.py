"""The training loop: resume, non-finite loss, callbacks, evaluation, summaries."""

import glob
import inspect
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import models
from tfmgpu.training import fused
from tfmgpu.training.loop import NonFiniteLossError, Trainer

DIGITS_ROWS = 256  # For the `digits` fixture.


def make_trainer(strategy, model="convnet", **kwargs):
  with strategy.scope():
    model = models.build_model(model, input_shape=(28, 28, 1),
                               num_classes=10, seed=0)
  kwargs.setdefault("verbose", 0)
  return Trainer(model, strategy=strategy, **kwargs)


def test_resume_after_epoch_2_equals_uninterrupted(digits, tmp_path):
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  whole = make_trainer(strategy, model_dir=str(tmp_path / "whole"))
  whole.fit(*digits, epochs=4, global_batch_size=32, steps_per_epoch=3)

  run_dir = str(tmp_path / "stopped")
  first = make_trainer(strategy, model_dir=run_dir)
  r1 = first.fit(*digits, epochs=2, global_batch_size=32, steps_per_epoch=3)
  assert (r1.epochs_run, r1.initial_epoch) == (2, 0)
  del first  # The process "stops"; a new one starts from the directory.
  second = make_trainer(strategy, model_dir=run_dir)
  r2 = second.fit(*digits, epochs=4, global_batch_size=32, steps_per_epoch=3)
  assert (r2.initial_epoch, r2.epochs_run, r2.steps) == (2, 2, 6)
  for a, b in zip(second.model.get_weights(), whole.model.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Optimizer state resumed too: Adam's step counter continued.
  assert int(second.optimizer.iterations.numpy()) == 12
  assert sorted(os.path.basename(p) for p in glob.glob(
      os.path.join(run_dir, "checkpoints", "ckpt-*.index"))) == [
          "ckpt-2.index", "ckpt-3.index", "ckpt-4.index"]


def test_resume_under_a_different_replica_count(digits, tmp_path):
  run_dir = str(tmp_path / "run")
  make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=4),
               model_dir=run_dir).fit(*digits, epochs=1, global_batch_size=32,
                                      steps_per_epoch=2)
  saved = make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=4),
                       model_dir=run_dir)
  saved.checkpointer.restore_latest()
  one = make_trainer(tfmgpu.get_strategy("one_device"), model_dir=run_dir)
  assert one.checkpointer.restore_latest() == 1
  for a, b in zip(one.model.get_weights(), saved.model.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_non_finite_loss_names_the_step_and_keeps_last_checkpoint(
    digits, tmp_path):
  x, y = digits
  # (An MLP: max-pooling would silently drop NaN inputs.)
  trainer = make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=2),
                         "mlp", model_dir=str(tmp_path))
  trainer.fit(x, y, epochs=1, global_batch_size=32, steps_per_epoch=4)
  bad_x = np.full_like(x, np.nan)  # Epoch 2 onwards sees poisoned inputs.
  with pytest.raises(NonFiniteLossError, match=r"Loss became .*n.n.* at step 5 "
                     r"\(epoch 2\).*last good checkpoint is .*ckpt-1"):
    trainer.fit(bad_x, y, epochs=3, global_batch_size=32, steps_per_epoch=4)
  ckpts = glob.glob(str(tmp_path / "checkpoints" / "ckpt-*.index"))
  assert [os.path.basename(c) for c in ckpts] == ["ckpt-1.index"]


def test_callbacks_are_honoured(digits):
  seen = []

  class Recorder(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
      seen.append((epoch, sorted(logs)))
      if epoch == 1:
        self.model.stop_training = True

  trainer = make_trainer(tfmgpu.get_strategy("default"), callbacks=[Recorder()])
  result = trainer.fit(*digits, epochs=5, global_batch_size=32,
                       steps_per_epoch=2, validation_data=digits)
  assert [e for e, _ in seen] == [0, 1]
  assert seen[0][1] == ["accuracy", "examples_per_sec", "loss", "val_accuracy",
                        "val_loss"]
  assert result.epochs_run == 2


def test_keras_callbacks_see_the_optimizer_and_every_batch(digits):
  """LearningRateScheduler / ReduceLROnPlateau read and set
  `model.optimizer` (the Trainer's while `fit` runs, removed after);
  `on_train_batch_begin` is called once per call, as Keras does."""
  begun = []

  class Begins(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      begun.append(batch)

  halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2)
  plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0,
                                              factor=0.5, min_delta=1e9)
  trainer = make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=2),
                         optimizer="sgd", learning_rate=0.1,
                         callbacks=[halve, plateau, Begins()])
  result = trainer.fit(*digits, epochs=2, global_batch_size=32,
                       steps_per_epoch=3)
  # Epoch 1 at 0.05 (scheduler; its first loss is the plateau's best),
  # epoch 2 at 0.025, then halved by the plateau: as Keras `fit` does.
  np.testing.assert_allclose(result.history["learning_rate"], [0.05, 0.025])
  assert float(trainer.optimizer.learning_rate.numpy()) == pytest.approx(0.0125)
  assert begun == [0, 1, 2] * 2
  assert not hasattr(trainer.model, "optimizer")


def test_ema_weights_are_put_into_the_model_after_fit(digits):
  """`use_ema=True`: as Keras `fit`, the model ends with the averages."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
  trainer = make_trainer(strategy, optimizer=optimizer)
  trainer.fit(*digits, epochs=1, global_batch_size=32, steps_per_epoch=3)
  averages = optimizer._model_variables_moving_average  # pylint: disable=protected-access
  for v, average in zip(trainer.model.trainable_weights, averages):
    np.testing.assert_array_equal(v.numpy(), average.numpy())


def test_a_rerun_with_nothing_to_train_ends_with_the_ema_weights(
    digits, tmp_path):
  """A rerun that finds the run done (say after a SIGTERM in the final
  evaluation) puts the averages into the model, as the run that trained
  did: its checkpoint holds the trained weights and their averages."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)

  def run():
    with strategy.scope():
      optimizer = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    trainer = make_trainer(strategy, optimizer=optimizer,
                           model_dir=str(tmp_path))
    trainer.fit(*digits, epochs=1, global_batch_size=32, steps_per_epoch=3)
    return trainer.model.get_weights()

  trained, rerun = run(), run()
  for a, b in zip(rerun, trained):
    np.testing.assert_array_equal(a, b)


def test_batch_norms_normalising_each_replica_say_so(caplog):
  """A new user's trial: mirrored trained a BatchNormalization model 1.1e-2
  off one device (each replica's own statistics, as Keras' fit) unsaid,
  where the pipeline's micro-batches said so."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)

  def build(synchronized):
    with strategy.scope():
      return keras.Sequential([
          keras.Input((4,)), keras.layers.BatchNormalization(
              synchronized=synchronized, name="bn"), keras.layers.Dense(2)],
          name=f"bn_{synchronized}")
  with caplog.at_level("WARNING"):
    Trainer(build(False), strategy=strategy, verbose=0)
  assert ("BatchNormalization layers (bn) normalise each of the 2 replicas' "
          "rows by their own statistics, as Keras' fit does under "
          "MirroredStrategy, so training differs from one device"
          ) in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING"):
    Trainer(build(True), strategy=strategy, verbose=0)
  assert "normalise" not in caplog.text


class _BatchStatisticLoss(keras.layers.Layer):
  """Adds a loss of a whole-batch statistic (as a router's balancing)."""

  def call(self, x):
    self.add_loss(keras.ops.square(keras.ops.std(x)))
    return x


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_random_draws_and_batch_losses_per_replica_say_so(caplog, zero_stage):
  """A trial's keras.io models under mirrored and ZeRO: augmentation
  (RandomFlip) trained 8.4e-3 off one device and a batch-statistic
  `add_loss` 0.061 off, with no word (BatchNorm and the pipeline said
  theirs). Dropout of rate 0, an activity regulariser (per example) and a
  weight regulariser (once a step) are exact and say nothing."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)

  def build(noisy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
      inputs = keras.Input((4, 4, 1))
      h = keras.layers.RandomFlip(name="flip")(inputs) if noisy else inputs
      h = keras.layers.Flatten(name="flat")(h)
      h = keras.layers.Dropout(0.0, name="no_drop")(h)
      h = keras.layers.Dense(
          3, name="dense", activity_regularizer=keras.regularizers.L2(0.1),
          kernel_regularizer=keras.regularizers.L2(0.1))(h)
      if noisy:
        h = _BatchStatisticLoss(name="balance")(h)
      return keras.Model(inputs, h, name=f"noisy_{noisy}")

  x = np.ones((8, 4, 4, 1), np.float32)
  y = np.zeros(8, np.int64)
  for noisy in (True, False):
    caplog.clear()
    with caplog.at_level("WARNING"):
      Trainer(build(noisy), strategy=strategy, zero_stage=zero_stage,
              optimizer="sgd", verbose=0).fit(x, y, global_batch_size=8)
    said = [r.getMessage() for r in caplog.records]
    draws = [m for m in said if "drawing random numbers" in m]
    losses = [m for m in said if "losses added in call()" in m]
    if not noisy:
      assert not draws and not losses, said
      continue
    assert len(draws) == 1 and "(flip)" in draws[0], said
    assert ("on each of the 2 replicas from the same seeds" in draws[0]
            if zero_stage == 0 else "each of its 2 data-parallel copies' rows"
            in draws[0]), draws
    adder = "balance" if zero_stage == 0 else "of 'noisy_True'"
    assert len(losses) == 1 and (
        f"by layers {adder} are computed on each of the 2 replicas' rows"
        in losses[0]), said


def test_a_model_with_its_own_step_is_refused(caplog):
  """The Trainer runs its own step; a model's `train_step` is never called.
  A warning was not enough: a keras.io step computing MAE with "mse"
  compiled trained MSE (a new user's trial). Refused, with or without a
  loss; a functional view sharing the weights trains with the Trainer."""

  class OwnStep(keras.Sequential):
    def train_step(self, data):
      raise AssertionError("never called")

  model = OwnStep([keras.Input((4,)), keras.layers.Dense(2)], name="own")
  plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  with caplog.at_level("WARNING"):
    Trainer(plain, verbose=0)
  assert "overrides" not in caplog.text
  with pytest.raises(ValueError, match=r"^model 'own' \(OwnStep\) overrides "
                     r"train_step: .* would train the loss you gave or "
                     r"compiled \(mse\), not what your step computes"):
    Trainer(model, loss="mse", verbose=0)
  with pytest.raises(ValueError, match=r"would train the default loss \(sparse "
                     r"categorical cross-entropy from logits\).*model\.fit "
                     r"under tfmgpu\.get_strategy\('mirrored'\)\.scope\(\)"
                     r", where TF sums the replicas' gradients: divide .* by "
                     r"self\.distribute_strategy\.num_replicas_in_sync\. "
                     r"To train the same layers .* keras\.Model\("
                     r"model\.inputs, model\.outputs\)"):
    Trainer(model, verbose=0)

  class PureOwn(keras.Model):  # No inputs: no view to offer.
    def __init__(self):
      super().__init__(name="pure")
      self.dense = keras.layers.Dense(2)

    def call(self, x):
      return self.dense(x)

    def train_step(self, data):
      raise AssertionError("never called")

  pure = PureOwn()
  pure(np.ones((1, 4), np.float32))
  with pytest.raises(ValueError, match=r"num_replicas_in_sync\.$"):
    Trainer(pure, loss="mse", verbose=0)
  view = keras.Model(model.inputs, model.outputs, name="view")
  trainer = Trainer(view, loss="mse", optimizer="sgd", verbose=0)
  before = model.get_weights()[0].copy()
  trainer.fit(np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32),
              epochs=1, global_batch_size=8)
  assert not np.array_equal(model.get_weights()[0], before)  # Shared.


def test_evaluate_counts_every_row_on_4_replicas(digits):
  x, y = digits[0][:101], digits[1][:101]
  trainer = make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=4))
  got = trainer.evaluate(x, y, global_batch_size=8)
  assert got["count"] == 101
  # Reference computed eagerly: Keras' own predict under this strategy fails
  # on the empty replica batches of 101 rows (see README troubleshooting).
  logits = trainer.model(x, training=False).numpy()
  expected = float(np.mean(np.argmax(logits, -1) == y))
  assert got["accuracy"] == pytest.approx(expected)
  ref_loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(
      y, logits, from_logits=True)))
  assert got["loss"] == pytest.approx(ref_loss, rel=1e-4)


def test_evaluation_of_arrays_runs_on_data_held_on_the_devices(digits):
  x, y = digits[0][:101], digits[1][:101]
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  held = make_trainer(strategy)
  streamed = Trainer(held.model, strategy=strategy, verbose=0,
                     input_mode="tf_data")
  got = held.evaluate(x, y, global_batch_size=8)
  want = streamed.evaluate(x, y, global_batch_size=8)
  assert held.evaluator.resident_function is not None and not held.evaluator.functions  # pylint: disable=protected-access
  assert streamed.evaluator.resident_function is None  # pylint: disable=protected-access
  assert got["count"] == want["count"] == 101
  for k in ("loss", "accuracy"):
    assert got[k] == pytest.approx(want[k], rel=1e-6)
  # Validation data is copied once per fit and dropped after it.
  held.fit(x, y, epochs=2, global_batch_size=8, steps_per_epoch=2,
           validation_data=(x, y))
  assert held.evaluator.held is None  # pylint: disable=protected-access
  assert held.evaluator.resident_function.experimental_get_tracing_count() == 1  # pylint: disable=protected-access


def test_float16_gets_loss_scaling_and_trains(digits):
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = models.build_model("convnet", input_shape=(28, 28, 1),
                               num_classes=10, seed=0,
                               mixed_precision="mixed_float16")
  trainer = Trainer(model, strategy=strategy, verbose=0)
  assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
  assert type(trainer.optimizer.inner_optimizer) is fused.FusedAdam
  result = trainer.fit(*digits, epochs=2, global_batch_size=32)
  assert np.isfinite(result.history["loss"]).all()
  assert result.history["loss"][-1] < result.history["loss"][0]


def test_summaries_are_written(digits, tmp_path):
  trainer = make_trainer(tfmgpu.get_strategy("default"),
                         model_dir=str(tmp_path))
  trainer.fit(*digits, epochs=1, global_batch_size=64, steps_per_epoch=2)
  trainer.close()
  events = glob.glob(str(tmp_path / "summaries" / "events.out.tfevents.*"))
  assert events
  tags = {v.tag for e in tf.compat.v1.train.summary_iterator(events[0])
          for v in e.summary.value}
  assert {"train/loss", "epoch/loss"} <= tags


def test_model_not_built_in_scope_is_a_clear_error():
  model = models.build_model("mlp", input_shape=(4,), num_classes=2)
  with pytest.raises(ValueError, match=r"was not built in the scope of the "
                     r"strategy.*strategy.scope\(\)"):
    Trainer(model, strategy=tfmgpu.get_strategy("mirrored", num_replicas=2))
  # A name makes a new strategy: the model cannot have been built in it.
  with pytest.raises(ValueError, match=r"strategy='mirrored' makes a new "
                     r"strategy, and model '.*' was built outside its scope.*"
                     r"tfmgpu.get_strategy\('mirrored'\)"):
    Trainer(model, strategy="mirrored")
  with pytest.raises(ValueError, match=r"not built in the scope of the "
                     r"strategy \(OneDeviceStrategy"):
    Trainer(model, strategy=tfmgpu.get_strategy("one_device"))
  assert Trainer(model, strategy="default").strategy is tf.distribute.get_strategy()
  # ZeRO shards a model made outside any scope over the named strategy's
  # devices.
  sharded = Trainer(models.build_model("mlp", input_shape=(4,), num_classes=2),
                    strategy="mirrored", zero_stage=1, verbose=0)
  assert sharded.model.stage == 1


def test_a_model_built_in_a_scope_trains_under_that_strategy_by_default():
  """Given no strategy=, it failed deep in the fused update ('tuple indices
  must be integers or slices, not MirroredVariable'); Keras' fit uses the
  model's."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  trainer = Trainer(model, optimizer="adam", verbose=0)
  assert trainer.strategy is strategy
  x = np.ones((16, 4), "float32")
  trainer.fit(x, np.arange(16) % 2, global_batch_size=8)


def test_bad_arguments(digits):
  trainer = make_trainer(tfmgpu.get_strategy("mirrored", num_replicas=4))
  with pytest.raises(ValueError, match=r"global_batch_size=30 is not divisible "
                     r"by the 4 replicas"):
    trainer.fit(*digits, global_batch_size=30)
  with pytest.raises(ValueError, match=r"steps_per_epoch=99 needs more data"):
    trainer.fit(*digits, global_batch_size=32, steps_per_epoch=99)
  with pytest.raises(ValueError, match=r"optimizer='adamax' is unknown"):
    make_trainer(tfmgpu.get_strategy("default"), optimizer="adamax")
  with pytest.raises(ValueError, match=r"learning_rate='0.1' is a string; "
                     r"pass a number, e.g. learning_rate=0.001"):
    make_trainer(tfmgpu.get_strategy("default"), learning_rate="0.1")
  with pytest.raises(ValueError, match=r"jit_compile='False' is a string; "
                     r"pass True or False, e.g. jit_compile=False"):
    make_trainer(tfmgpu.get_strategy("default"), jit_compile="False")
  # It restored the weights alone and trained the restored epochs again.
  with pytest.raises(ValueError, match=r"BackupAndRestore.*Pass model_dir"):
    make_trainer(tfmgpu.get_strategy("default"), callbacks=[
        keras.callbacks.BackupAndRestore("unused_backup_dir")])


def test_keras_argument_names_say_what_the_trainer_takes(digits):
  """`fit(x, y, batch_size=32)` was Python's bare "unexpected keyword
  argument"; Keras users type it first."""
  trainer = make_trainer(tfmgpu.get_strategy("default"))
  with pytest.raises(TypeError, match=r"Trainer\.fit\(\) got batch_size=32, "
                     r"Keras' name: tfmgpu's Trainer takes "
                     r"global_batch_size=32 \(examples per step over all "
                     r"replicas\)"):
    trainer.fit(*digits, epochs=1, batch_size=32)
  with pytest.raises(TypeError, match=r"Trainer\.evaluate\(\) got "
                     r"batch_size=16, .* global_batch_size=16"):
    trainer.evaluate(*digits, batch_size=16)
  with pytest.raises(TypeError, match=r"takes Trainer\(model, verbose=0, "):
    trainer.fit(*digits, verbose=0)
  with pytest.raises(TypeError, match=r"got validation_split=0\.2, Keras' "
                     r"name: .* fit\(x\[:k\], y\[:k\], validation_data=\("
                     r"x\[k:\], y\[k:\]\), \.\.\.\) with k = int\(len\(x\) "
                     r"\* \(1 - 0\.2\)\)"):
    trainer.fit(*digits, validation_split=0.2)
  with pytest.raises(TypeError, match=r"evaluate\(\) got return_dict=True"):
    trainer.evaluate(*digits, return_dict=True)
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'epoch'"):
    trainer.fit(*digits, epoch=1)
  assert "global_batch_size" in inspect.signature(Trainer.fit).parameters


@pytest.mark.parametrize("kind", ["dataset", "function", "unknown_length"])
def test_a_dataset_longer_than_an_epoch_runs_on_like_keras(kind):
  # 6 batches, 2 steps per epoch: epoch k trains on batches 2k and 2k + 1
  # (Keras' iterator runs on); restarting each epoch would see 0, 1 thrice.
  # TF knows no length after `filter` (or of `from_generator`): it runs on
  # too (it restarted each epoch).
  rng = np.random.default_rng(0)
  x = rng.normal(size=(48, 5)).astype("float32")
  y = rng.normal(size=(48, 1)).astype("float32")
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  if kind == "unknown_length":
    dataset = dataset.filter(lambda *_: True)
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY

  def build():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])

  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  reference.fit(dataset, epochs=3, steps_per_epoch=2, verbose=0)
  model = build()
  trainer = Trainer(model, optimizer="sgd", learning_rate=0.1, loss="mse",
                    verbose=0)
  source = (lambda ctx: dataset) if kind == "function" else dataset
  trainer.fit(source, epochs=3, steps_per_epoch=2)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  trainer.fit(source, epochs=5, steps_per_epoch=2)  # A new pass: no error.


def test_a_callback_stopping_mid_epoch_stops_after_that_batch_like_keras():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(48, 5)).astype("float32")
  y = rng.normal(size=(48, 1)).astype("float32")

  class StopAt(keras.callbacks.Callback):
    def __init__(self):
      super().__init__()
      self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
      self.batches += 1
      if self.batches == 5:  # Batch 1 of epoch 2 (3 batches an epoch).
        self.model.stop_training = True

  def build():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])

  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                callbacks=[StopAt()])
  model, stop = build(), StopAt()
  trainer = Trainer(model, optimizer="sgd", learning_rate=0.1, loss="mse",
                    verbose=0, callbacks=[stop])
  result = trainer.fit(x, y, epochs=3, global_batch_size=16, shuffle=False)
  assert stop.batches == 5 and len(result.history["loss"]) == 2
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_users_tensorboard_callback_gets_no_summaries_of_the_trainers(
    tmp_path):
  """Without model_dir the Trainer's epoch/* scalars went to the callback's
  writer, the default one then."""
  import glob  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 5)).astype("float32")
  y = rng.normal(size=(32, 1)).astype("float32")
  model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
  Trainer(model, loss="mse", verbose=0, callbacks=[keras.callbacks.TensorBoard(
      str(tmp_path), update_freq="batch")]).fit(
          x, y, epochs=2, global_batch_size=8, validation_data=(x, y))
  tags = {v.tag for f in glob.glob(str(tmp_path / "*" / "events*"))
          for e in tf.compat.v1.train.summary_iterator(f)
          for v in e.summary.value}
  assert {"batch_loss", "epoch_loss"} <= tags, tags
  assert not any(t.startswith("epoch/") for t in tags), tags


def test_trainers_made_in_a_row_do_not_report_retracing(caplog):
  """A notebook makes a Trainer per experiment: each one's functions trace
  once, and TF does not warn of retracing (it counted every Trainer's
  calls under one code object and warned from the fifth)."""
  import logging  # pylint: disable=g-import-not-at-top
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  y = rng.integers(0, 2, 64)
  with caplog.at_level(logging.WARNING, logger="tensorflow"):
    for seed in range(6):
      with strategy.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(2, name=f"d{seed}")])
      trainer = Trainer(model, strategy=strategy, verbose=0)
      trainer.fit(x, y, epochs=2, global_batch_size=16,
                  validation_data=(x[:20], y[:20]))
      trainer.evaluate(x, y, global_batch_size=16)
  assert "retracing" not in caplog.text


@pytest.mark.parametrize("replicas", [1, 2])
def test_clip_norm_under_float16_clips_the_unscaled_gradient(digits,
                                                             replicas):
  """The summed gradient is still multiplied by the loss scale when it is
  clipped: clipping it there shrank every step by the scale (32768), so a
  float16 run with clip_norm barely moved. Now as Keras' global_clipnorm."""
  x, y = digits[0][:96].reshape(96, -1), digits[1][:96]

  def build():  # No dropout: the two runs see the same arithmetic.
    keras.utils.set_random_seed(0)
    with models.dtype_policy("mixed_float16"):  # The model's own policy:
      return keras.Sequential([  # Keras' compile reads it to scale.
          keras.Input(x.shape[1:]),
          keras.layers.Dense(32, activation="relu"),
          keras.layers.Dense(10, activation="softmax", dtype="float32")])

  reference = build()
  reference.compile(optimizer=keras.optimizers.LossScaleOptimizer(
      keras.optimizers.SGD(0.5, global_clipnorm=0.1)),
                    loss="sparse_categorical_crossentropy")
  reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=replicas)
  with strategy.scope():
    model = build()
  trainer = Trainer(model, strategy=strategy, verbose=0, metrics=[],
                    optimizer=keras.optimizers.SGD(0.5), clip_norm=0.1)
  assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
  trainer.fit(x, y, epochs=1, global_batch_size=32, shuffle=False)
  moved = max(float(np.abs(a - b).max()) for a, b in
              zip(reference.get_weights(), build().get_weights()))
  diff = max(float(np.abs(a - b).max()) for a, b in
             zip(model.get_weights(), reference.get_weights()))
  assert moved > 1e-3 and diff < 1e-4, (moved, diff)


@pytest.mark.parametrize("strategy,options", [
    ("default", {}), ("mirrored", {"clip_norm": 0.05}),
    ("mirrored", {"fused_optimizer": True})])
def test_an_optimizers_loss_scale_factor_scales_the_loss_as_keras_does(
    strategy, options):
  """Keras scales the loss by `loss_scale_factor` and `apply` divides the
  gradients by it: the Trainer did only the second (steps 128x smaller)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 5)).astype("float32")
  y = rng.normal(size=(64, 1)).astype("float32")
  optimizer = keras.optimizers.SGD if "fused_optimizer" not in options else (
      keras.optimizers.Adam)

  def build():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(
        8, activation="tanh"), keras.layers.Dense(1)])

  reference = build()
  reference.compile(loss="mse", optimizer=optimizer(
      0.1, loss_scale_factor=128.0, global_clipnorm=options.get("clip_norm")))
  reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  strategy = tfmgpu.get_strategy(strategy)
  with strategy.scope():
    model = build()
  Trainer(model, strategy=strategy, loss="mse", verbose=0, optimizer=optimizer(
      0.1, loss_scale_factor=128.0), **options).fit(
          x, y, epochs=2, global_batch_size=16, shuffle=False)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_changing_trainable_after_the_trainer_is_made_is_refused():
  """keras.io's fine-tuning workflow unfreezes the base between two fits:
  the Trainer's step went on training the old weights (the base moved by
  0.0), as Keras would without compile()."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 6)).astype("float32")
  y = (x[:, 0] > 0).astype("int32")
  keras.utils.set_random_seed(0)
  base = keras.layers.Dense(8, activation="relu", name="base")
  model = keras.Sequential([keras.Input((6,)), base, keras.layers.Dense(2)],
                           name="tuned")
  base.trainable = False
  trainer = Trainer(model, optimizer="sgd", learning_rate=0.1, verbose=0)
  trainer.fit(x, y, global_batch_size=16)
  base.trainable = True
  with pytest.raises(ValueError, match=r"trainable weights changed since this "
                     r"Trainer was made: 2 now trainable \(tuned/base/kernel, "
                     r"tuned/base/bias\).*Make a new Trainer"):
    trainer.fit(x, y, global_batch_size=16)
  before = base.get_weights()[0].copy()
  Trainer(model, optimizer="sgd", learning_rate=0.1, verbose=0).fit(
      x, y, global_batch_size=16)
  assert np.abs(base.get_weights()[0] - before).max() > 1e-4


def test_rows_no_global_batch_holds_are_named(caplog):
  """100 rows in batches of 32 train 96 an epoch; with shuffle=False the
  last 4 were never trained, without a word (Keras trains them)."""
  x = np.zeros((100, 3), "float32")
  y = np.zeros((100,), "int32")
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  trainer = Trainer(model, optimizer="sgd", verbose=0)
  with caplog.at_level("INFO"):
    trainer.fit(x, y, global_batch_size=32, shuffle=False)
    trainer.fit(x, y, global_batch_size=32)
    trainer.fit(x, y, global_batch_size=25)
  said = [(r.levelname, r.getMessage()) for r in caplog.records
          if "global batches of" in r.getMessage()]
  assert [level for level, _ in said] == ["WARNING", "INFO"]
  assert said[0][1].startswith(
      "100 examples make 3 global batches of 32: each epoch trains 96 and "
      "leaves 4 out, always the last ones (shuffle=False)")


def _stateful_rnn():
  keras.utils.set_random_seed(0)
  x = keras.Input(batch_shape=(8, 5, 4))
  h = keras.layers.LSTM(6, stateful=True, name="lstm")(x)
  return keras.Model(x, keras.layers.Dense(3, name="head")(h), name="rnn")


def test_a_stateful_rnn_trains_as_keras_on_one_device_only():
  """One device carries the state as Keras' fit and predict do; under
  two replicas each ran its own rows against the one state (trained with
  no error), and predict failed deep in Keras: refused up front."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 5, 4)).astype("float32")
  y = rng.integers(0, 3, 32).astype("int32")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  reference, model = _stateful_rnn(), _stateful_rnn()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
  reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  Trainer(model, optimizer=keras.optimizers.SGD(0.1), loss=loss, verbose=0,
          metrics=[]).fit(x, y, global_batch_size=8, shuffle=False)
  for a, b in zip(model.get_weights() + model.get_layer("lstm").states,
                  reference.get_weights() + reference.get_layer("lstm").states):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(tfmgpu.predict(model, x, batch_size=8),
                             reference.predict(x, batch_size=8, verbose=0),
                             rtol=1e-6, atol=1e-7)
  refused = r"model 'rnn' has stateful RNN layers \('lstm'.*cannot run {}"
  with pytest.raises(ValueError, match=refused.format("under Mirrored")):
    tfmgpu.predict(_stateful_rnn(), x, batch_size=16, strategy=tfmgpu
                   .get_strategy("mirrored", num_replicas=2))
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    replicated = _stateful_rnn()
  with pytest.raises(ValueError, match=refused.format(
      r"under MirroredStrategy \(2 replicas\)")):
    Trainer(replicated, strategy=strategy, loss=loss)
  with pytest.raises(ValueError, match=r"batch_splits=2 cannot train model "
                     r"'rnn' exactly: its stateful RNN layers \(lstm\)"):
    Trainer(_stateful_rnn(), loss=loss, batch_splits=2)


def test_a_fit_that_trains_nothing_says_so(tmp_path, caplog):
  """A trial: a second `fit(epochs=1)` with a `model_dir` trained nothing
  (epochs counts the run's total) and said nothing: the user took it for a
  second epoch, as in Keras."""
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)],
                           name="twice")
  trainer = Trainer(model, optimizer="sgd", verbose=0,
                    model_dir=str(tmp_path / "run"))
  x, y = np.ones((16, 4), np.float32), np.zeros(16, np.int64)
  trainer.fit(x, y, epochs=1, global_batch_size=8)
  before = model.get_weights()
  with caplog.at_level("WARNING"):
    trainer.fit(x, y, epochs=1, global_batch_size=8)
  for a, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(a, b)
  assert re.search(r"fit\(epochs=1\) trains nothing: the checkpoints in .* "
                   r"already hold 1 epoch\(s\)\..* pass epochs=2 to train "
                   r"one more", caplog.text), caplog.text
