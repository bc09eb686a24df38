"""Real workloads through the Trainer: several inputs and outputs, datasets,
dataset functions, sample weights, any loss and metric, each equal to Keras.

The reference is Keras itself: `model.fit` / `model.evaluate` on one device
with the same initial weights, the same batches in the same order and SGD.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.training.loop import Trainer

ROWS, BATCH, EPOCHS, LR = 64, 16, 2, 0.05
# Mirrored x4 takes x2's path (it is trained below, in the regression test).
STRATEGIES = ["default", "mirrored x2"]


def _strategy(name):
  if name == "default":
    return tf.distribute.get_strategy()
  return tfmgpu.get_strategy("mirrored", num_replicas=int(name[-1]))


def _data(seed=0):
  rng = np.random.default_rng(seed)
  image = rng.normal(size=(ROWS, 6, 6, 1)).astype(np.float32)
  tab = rng.normal(size=(ROWS, 5)).astype(np.float32)
  label = ((image.mean(axis=(1, 2, 3)) + tab[:, 0]) > 0).astype(np.int32)
  target = (tab @ np.arange(1, 6, dtype=np.float32))[:, None] * 0.1
  return {"image": image, "tab": tab}, label, target


def _two_input_model(outputs=("class",)):
  """image + tabular -> logits (and a regression head)."""
  image = keras.Input((6, 6, 1), name="image")
  tab = keras.Input((5,), name="tab")
  h = keras.layers.Conv2D(3, 3, activation="relu", name="conv")(image)
  h = keras.layers.Flatten(name="flat")(h)
  t = keras.layers.Dense(4, activation="tanh", name="tab_dense")(tab)
  h = keras.layers.Concatenate(name="join")([h, t])
  heads = {"class": keras.layers.Dense(2, name="class")(h),
           "value": keras.layers.Dense(1, name="value")(h)}
  out = [heads[o] for o in outputs]
  return keras.Model({"image": image, "tab": tab},
                     out[0] if len(out) == 1 else out)


def _built(strategy, weights, outputs=("class",)):
  with strategy.scope():
    model = _two_input_model(outputs)
  model.set_weights(weights)
  return model


@pytest.fixture(scope="module")
def initial():
  keras.utils.set_random_seed(0)
  return _two_input_model(("class", "value")).get_weights()


def _keras_reference(weights, loss, x, y, outputs=("class",), **fit_kwargs):
  model = _two_input_model(outputs)
  model.set_weights(weights)
  model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
  model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
            **fit_kwargs)
  return model.get_weights()


def _class_weights(initial):
  """The initial weights of the one-output model (no `value` head)."""
  probe = _two_input_model()
  names = [v.path for v in probe.weights]
  full = _two_input_model(("class", "value"))
  by_path = dict(zip([v.path for v in full.weights], initial))
  return [by_path[n] for n in names]


def _sources(x, y):
  """The same batches as arrays, a dataset and a dataset function."""
  def dataset_fn(ctx):
    per_replica = ctx.get_per_replica_batch_size(BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)
  return {
      "arrays": dict(x=x, y=y, global_batch_size=BATCH, shuffle=False),
      "dataset": dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)),
      "dataset_fn": dict(x=dataset_fn),
  }


@pytest.fixture(scope="module")
def dict_fed_keras(initial):
  """Keras' weights after training the one-output model on `_data()`, the
  reference of every source and strategy."""
  x, label, _ = _data()
  return _keras_reference(_class_weights(initial), keras.losses.
                          SparseCategoricalCrossentropy(from_logits=True),
                          x, label)


@pytest.mark.parametrize("source", ["arrays", "dataset", "dataset_fn"])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_a_dict_fed_two_input_model_trains_like_keras(initial, source,
                                                      strategy_name,
                                                      dict_fed_keras):
  x, label, _ = _data()
  weights = _class_weights(initial)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  expected = dict_fed_keras
  strategy = _strategy(strategy_name)
  model = _built(strategy, weights)
  trainer = Trainer(model, strategy=strategy, optimizer="sgd",
                    learning_rate=LR, loss=loss, verbose=0)
  result = trainer.fit(epochs=EPOCHS, **_sources(x, label)[source])
  assert result.steps == EPOCHS * ROWS // BATCH
  assert max(np.abs(e - w).max() for e, w in zip(expected, weights)) > 1e-3
  for got, want in zip(model.get_weights(), expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_multi_output_model_with_per_output_losses_trains_like_keras(initial):
  x, label, target = _data(1)
  loss = {"class": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          "value": "mse"}
  y = {"class": label, "value": target}
  outputs = ("class", "value")
  expected = _keras_reference(initial, loss, x, y, outputs,
                              )
  strategy = _strategy("mirrored x2")
  model = _built(strategy, initial, outputs)
  trainer = Trainer(model, strategy=strategy, optimizer="sgd",
                    learning_rate=LR, loss=loss,
                    metrics={"class": ["accuracy"], "value": ["mae"]},
                    verbose=0)
  result = trainer.fit(x, y, epochs=EPOCHS, global_batch_size=BATCH,
                       shuffle=False)
  for got, want in zip(model.get_weights(), expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert {"loss", "class_accuracy", "value_mae"} <= set(result.history)


def test_central_storage_reports_the_losses_and_metrics_of_one_device(
    initial, caplog):
  """Keras 3.15's own fit under CentralStorageStrategy reports wrong losses
  and metrics (right weights); get_strategy warns, and the Trainer it points
  to reports what Keras on one device does."""
  x, label, _ = _data()
  weights = _class_weights(initial)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  reference = _two_input_model()
  reference.set_weights(weights)
  reference.compile(optimizer=keras.optimizers.SGD(LR), loss=loss,
                    metrics=["accuracy"])
  want = reference.fit(x, label, batch_size=BATCH, epochs=EPOCHS,
                       shuffle=False, verbose=0).history
  strategy = tfmgpu.get_strategy("central_storage", num_replicas=2)
  assert "report wrong losses and metrics" in caplog.text
  assert "updated inside your own strategy.run loop" in caplog.text
  model = _built(strategy, weights)
  got = Trainer(model, strategy=strategy, optimizer="sgd", learning_rate=LR,
                loss=loss, metrics=["accuracy"], verbose=0).fit(
                    x, label, epochs=EPOCHS, global_batch_size=BATCH,
                    shuffle=False).history
  for key in ("loss", "accuracy"):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
  for got_w, want_w in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)


def test_regression_mse_and_mae_equal_keras_evaluate_on_the_same_weights():
  x, _, target = _data(2)
  strategy = _strategy("mirrored x4")
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = _two_input_model(("value",))
  trainer = Trainer(model, strategy=strategy, optimizer="sgd",
                    learning_rate=LR, loss="mse", metrics=["mae"], verbose=0)
  result = trainer.fit(x, target, epochs=2, global_batch_size=BATCH,
                       validation_data=(x, target))
  # 61 rows: the last batch of the evaluation is padded and masked out.
  got = trainer.evaluate({k: v[:61] for k, v in x.items()}, target[:61],
                         global_batch_size=BATCH)
  reference = _two_input_model(("value",))
  reference.set_weights(model.get_weights())
  reference.compile(loss="mse", metrics=["mae"])
  want = reference.evaluate({k: v[:61] for k, v in x.items()}, target[:61],
                            batch_size=7, verbose=0, return_dict=True)
  assert got["count"] == 61
  assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
  assert got["mae"] == pytest.approx(want["mae"], rel=1e-5)
  assert set(result.history) >= {"loss", "mae", "val_loss", "val_mae"}
  assert "accuracy" not in result.history


def test_float64_arrays_are_cast_to_float32_as_keras_does():
  """NumPy's default float64 targets met a float32 prediction in the user's
  loss ('Sub' op: float32 does not match float64); Keras casts them."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(32, 3)), rng.normal(size=(32, 1))  # float64.

  def loss(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
  reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  model = build()
  Trainer(model, optimizer="sgd", learning_rate=LR, loss=loss,
          verbose=0).fit(x, y, global_batch_size=8, shuffle=False)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sample_weights_weigh_the_loss_like_keras(initial):
  x, label, _ = _data(3)
  weights = _class_weights(initial)
  sw = np.linspace(0.0, 2.0, ROWS).astype(np.float32)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  expected = _keras_reference(weights, loss, x, label, sample_weight=sw)
  strategy = _strategy("mirrored x2")
  model = _built(strategy, weights)
  Trainer(model, strategy=strategy, optimizer="sgd", learning_rate=LR,
          loss=loss, verbose=0).fit(x, label, sample_weight=sw,
                                    epochs=EPOCHS, global_batch_size=BATCH,
                                    shuffle=False)
  for got, want in zip(model.get_weights(), expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_class_weights_weigh_the_loss_like_keras(initial, source):
  """`fit(class_weight=...)` was Python's bare 'unexpected keyword'."""
  x, label, _ = _data(4)
  weights = _class_weights(initial)
  class_weight = {0: 0.25, 1: 3.0}
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  expected = _keras_reference(weights, loss, x, label,
                              class_weight=class_weight)
  strategy = _strategy("mirrored x2")
  model = _built(strategy, weights)
  trainer = Trainer(model, strategy=strategy, optimizer="sgd",
                    learning_rate=LR, loss=loss, verbose=0)
  trainer.fit(epochs=EPOCHS, class_weight=class_weight,
              **_sources(x, label)[source])
  for got, want in zip(model.get_weights(), expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="class_weight and sample_weight were "
                     r"both given.*np.take\(weights, y\)"):
    trainer.fit(x, label, sample_weight=np.ones(ROWS), class_weight={0: 1.0})
  with pytest.raises(TypeError, match="x is a dataset function"):
    trainer.fit(class_weight={0: 1.0}, **_sources(x, label)["dataset_fn"])
  with pytest.raises(ValueError, match=r"class_weight=\[1.0\] must be a dict"):
    trainer.fit(x, label, class_weight=[1.0])


def test_an_infinite_dataset_needs_steps_per_epoch_and_runs_on(initial):
  x, label, _ = _data()
  model = _built(tf.distribute.get_strategy(), _class_weights(initial))
  trainer = Trainer(model, optimizer="sgd", learning_rate=LR, verbose=0)
  endless = tf.data.Dataset.from_tensor_slices((x, label)).batch(BATCH).repeat()
  with pytest.raises(ValueError, match="x is a dataset infinite: pass "
                     "steps_per_epoch"):
    trainer.fit(endless, epochs=1)
  result = trainer.fit(endless, epochs=3, steps_per_epoch=3)
  assert result.steps == 9


@pytest.mark.parametrize("call, message", [
    (lambda t, x, y: t.fit([x["image"], x["tab"][:10]], y),
     r"different numbers of rows \(x\[0\]: 64, x\[1\]: 10, y: 64\)"),
    (lambda t, x, y: t.fit(tf.data.Dataset.from_tensor_slices(x).batch(8)),
     r"yields dict elements.*\(x, y\) or \(x, y, sample_weight\)"),
    (lambda t, x, y: t.fit(tf.data.Dataset.from_tensor_slices((x, y)), y),
     r"y and sample_weight must be None when x is a tf.data.Dataset"),
    (lambda t, x, y: t.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
                           global_batch_size=8),
     r"global_batch_size=8 is for arrays"),
    (lambda t, x, y: t.fit(x),
     r"x is given as arrays without y"),
    (lambda t, x, y: t.fit({"image": np.array([{}] * 64), "tab": x["tab"]}, y),
     r"x\['image'\] is not an array of numbers or strings"),
])
def test_bad_inputs_are_named(initial, call, message):
  x, label, _ = _data()
  model = _built(tf.distribute.get_strategy(), _class_weights(initial))
  trainer = Trainer(model, verbose=0)
  with pytest.raises((ValueError, TypeError), match=message):
    call(trainer, x, label)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored x2"])
def test_predict_on_dicts_and_datasets_returns_every_row_in_order(
    initial, strategy_name):
  x, label, _ = _data(4)
  x = {k: v[:61] for k, v in x.items()}  # 61 rows: a padded last batch.
  outputs = ("class", "value")
  strategy = _strategy(strategy_name)
  model = _built(strategy, initial, outputs)
  reference = _two_input_model(outputs)
  reference.set_weights(initial)
  want = reference.predict(x, batch_size=8, verbose=0)
  from_arrays = tfmgpu.predict(model, x, strategy=strategy, batch_size=16)
  dataset = tf.data.Dataset.from_tensor_slices((x, label[:61])).batch(12)
  from_dataset = tfmgpu.predict(model, dataset, strategy=strategy)
  in_one_call = tfmgpu.predict(model, x, strategy=strategy)  # 61 < 1024 rows.
  for got in (from_arrays, from_dataset, in_one_call):
    assert isinstance(got, list) and len(got) == 2
    for g, w in zip(got, want):
      assert g.shape == w.shape == (61, w.shape[1])
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_split_two_output_model_takes_per_output_losses(initial, cpu_devices):
  from tfmgpu.parallel import partition, staged  # pylint: disable=g-import-not-at-top
  x, label, target = _data(5)
  outputs = ("class", "value")
  loss = {"class": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          "value": "mse"}
  y = {"class": label, "value": target}
  default = tf.distribute.get_strategy()

  def train(model):
    trainer = Trainer(model, optimizer="sgd", learning_rate=LR, loss=loss,
                      verbose=0)  # No metrics: none for either output.
    return trainer.fit(x, y, epochs=1, global_batch_size=BATCH, shuffle=False)

  unsplit = _built(default, initial, outputs)
  split = staged.StagedModel(_built(default, initial, outputs),
                             partition.plan_stages(unsplit, 2,
                                                   devices=cpu_devices[:2]))
  want, got = train(unsplit), train(split)
  # No metrics, but each output's loss, as Keras logs them.
  assert set(got.history) == {"loss", "class_loss", "value_loss",
                              "examples_per_sec"}
  for key in ("loss", "class_loss", "value_loss"):
    np.testing.assert_allclose(got.history[key], want.history[key],
                               rtol=1e-5)
  for g, w in zip(split.to_unsplit().get_weights(), unsplit.get_weights()):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_1f1b_pipeline_from_a_dataset_trains_like_from_arrays(initial,
                                                                cpu_devices):
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  x, label, _ = _data(6)
  weights = _class_weights(initial)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def train(**source):
    model = pipeline.PipelinedModel.from_model(
        _built(tf.distribute.get_strategy(), weights), num_stages=2,
        micro_batches=4, schedule="1f1b", devices=cpu_devices[:2])
    result = Trainer(model, optimizer="sgd", learning_rate=LR, loss=loss,
                     verbose=0).fit(epochs=1, **source)
    return result.history["loss"], model.to_unsplit().get_weights()

  want_loss, want = train(x=x, y=label, global_batch_size=BATCH, shuffle=False)
  got_loss, got = train(x=tf.data.Dataset.from_tensor_slices(
      (x, label)).batch(BATCH))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
