"""Optimizers a Trainer is given: names, and objects made outside its scope."""

import logging

import keras
import numpy as np
import pytest

import tfmgpu
from tfmgpu import models
from tfmgpu.training.loop import Trainer

DIGITS_ROWS = 128  # For the `digits` fixture.


def train(strategy, optimizer_fn, digits):
  """Weights after 4 steps of an MLP; `optimizer_fn()` is called outside."""
  optimizer = optimizer_fn()  # Outside any strategy scope, as users do.
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(28, 28, 1),
                               num_classes=10, seed=0)
  trainer = Trainer(model, strategy=strategy, optimizer=optimizer, verbose=0)
  trainer.fit(*digits, epochs=1, global_batch_size=32, steps_per_epoch=4)
  return trainer


def test_optimizer_made_outside_the_scope_is_recreated_in_it(digits):
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  outside = train(strategy, lambda: keras.optimizers.Adam(learning_rate=3e-3),
                  digits)
  bound = outside.optimizer._distribution_strategy  # pylint: disable=protected-access
  assert bound is strategy
  assert outside.optimizer.learning_rate.numpy() == pytest.approx(3e-3)
  assert int(outside.optimizer.iterations.numpy()) == 4

  # The same training with the optimizer created inside the scope.
  with strategy.scope():
    inside_optimizer = keras.optimizers.Adam(learning_rate=3e-3)
  inside = train(strategy, lambda: inside_optimizer, digits)
  assert inside.optimizer is inside_optimizer  # Already bound: kept as is.
  for a, b in zip(outside.model.get_weights(), inside.model.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_built_optimizer_from_outside_is_a_clear_error():
  optimizer = keras.optimizers.SGD(name="sgd")
  optimizer.build([keras.Variable(np.zeros(3, np.float32))])
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(4,), num_classes=2)
  with pytest.raises(ValueError, match=r"optimizer=SGD\(name='sgd'\) was "
                     r"created outside this strategy's scope and has already "
                     r"built.*inside `with strategy.scope\(\):`.*"
                     r"optimizer='adam'"):
    Trainer(model, strategy=strategy, optimizer=optimizer, verbose=0)


def test_gradient_accumulation_under_a_strategy_is_a_clear_error(digits):
  """Keras accumulates in a tf.cond that a distributed update cannot cross
  (TF's "merge_call called while defining a new graph" otherwise)."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2\).*"
                     r"MirroredStrategy.*global_batch_size by 2.*"
                     r"Layout\(data=<copies>, micro_batches=2, "
                     r"schedule='1f1b'\)"):
    train(strategy, lambda: keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=2), digits)
  with pytest.raises(ValueError, match=r"use_ema=True, ema_overwrite_"
                     r"frequency=3\) cannot train under MirroredStrategy"):
    train(strategy, lambda: keras.optimizers.Adam(
        use_ema=True, ema_overwrite_frequency=3), digits)


def test_weight_decay_exclusions_follow_the_optimizer_into_the_scope():
  """AdamW re-created in the scope lost `exclude_from_weight_decay(var_list=)`
  (not in its config): the excluded weights were decayed (2.8e-2 off one
  device in 3 steps), silently. An exclusion of variables the run does not
  train is refused, naming the way that follows copies."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(4,), num_classes=2)
  biases = [v for v in model.trainable_variables if len(v.shape) == 1]
  optimizer = keras.optimizers.AdamW(weight_decay=0.5)
  optimizer.exclude_from_weight_decay(var_list=biases)
  trainer = Trainer(model, strategy=strategy, optimizer=optimizer, verbose=0)
  assert trainer.optimizer is not optimizer  # Re-created in the scope.
  assert not any(trainer.optimizer._use_weight_decay(v) for v in biases)  # pylint: disable=protected-access
  other = keras.optimizers.AdamW(weight_decay=0.5)
  other.exclude_from_weight_decay(var_list=[keras.Variable(np.zeros(2))])
  with pytest.raises(ValueError, match=r"names 1 variable\(s\) that model "
                     r".* does not train.*var_names="):
    Trainer(model, strategy=strategy, optimizer=other, verbose=0)


def test_a_multi_optimizer_on_two_replicas_steps_as_on_one_device():
  """Its inner optimizers all-reduced the (already summed) gradients once
  more: the step was twice Keras'."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=(16, 5)).astype("float32")
  y = rng.normal(size=(16, 1)).astype("float32")

  def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(1, name="d")(inputs))

  def multi():
    return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        default_optimizer=keras.optimizers.SGD(0.1)))

  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  reference.fit(x, y, batch_size=16, verbose=0)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = build()
    optimizer = multi()
  Trainer(model, strategy=strategy, optimizer=optimizer, loss="mse",
          metrics=[], verbose=0).fit(x, y, global_batch_size=16, epochs=1)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_compiled_model_trains_with_its_compile_unless_told_otherwise():
  """It trained with the Trainer's defaults (Adam 1e-3, cross-entropy from
  logits on a softmax output): 0.17 off its own `fit`, silently."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=(16, 5)).astype("float32")
  y = rng.randint(0, 3, 16).astype("int32")

  def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(
        3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model

  reference = build()
  reference.fit(x, y, batch_size=16, verbose=0)
  model = build()
  result = Trainer(model, verbose=0).fit(x, y, global_batch_size=16,
                                         epochs=1)
  assert "accuracy" in result.history
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-6)
  told = Trainer(build(), optimizer="adam", verbose=0)
  assert type(told.optimizer).__name__ != "SGD"
  # Options take compile's too, for the fields they leave at defaults
  # (they took nothing: Adam at 1e-3 and cross-entropy from logits).
  model = build()
  Trainer(model, options=tfmgpu.TrainerOptions(verbose=0)).fit(
      x, y, global_batch_size=16, epochs=1)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-6)
  told = Trainer(build(), options=tfmgpu.TrainerOptions(optimizer="sgd"))
  assert type(told.optimizer).__name__ != "SGD" or (
      float(told.optimizer.learning_rate.numpy()) != 0.5)
  with pytest.raises(ValueError, match=r"learning_rate=0.0005 was given "
                     r"with optimizer=Adam"):
    Trainer(build(), options=tfmgpu.TrainerOptions(
        optimizer=keras.optimizers.Adam(1e-2), learning_rate=5e-4))


def test_a_compiled_steps_per_execution_runs_batch_callbacks_as_fit_does(
    caplog):
  """A trial: `compile(steps_per_execution=3)` was dropped; batch callbacks
  ran every step where `fit` runs them once per call, and a callback
  setting the rate per call ended 4.9e-2 from `fit`. `jit_compile=True` is
  said, not taken."""
  x = np.random.RandomState(0).normal(size=(24, 5)).astype("float32")
  y = np.arange(24) % 3

  class Batches(keras.callbacks.Callback):
    def __init__(self):
      super().__init__()
      self.seen = []

    def on_train_batch_end(self, batch, logs=None):
      self.seen.append(batch)

  def build():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)],
                             name="spe")
    model.compile(optimizer="sgd", steps_per_execution=3, jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model

  reference, ours = Batches(), Batches()
  build().fit(x, y, batch_size=4, callbacks=[reference], verbose=0)
  caplog.set_level(logging.INFO)
  trainer = Trainer(build(), callbacks=[ours], verbose=0)
  trainer.fit(x, y, global_batch_size=4, epochs=1)
  assert trainer.options.steps_per_execution == 3
  assert ours.seen == reference.seen == [2, 5]
  assert "takes its optimizer, loss, steps_per_execution" in caplog.text
  assert "compiled with jit_compile=True; the Trainer compiles" in caplog.text
  assert not trainer.options.jit_compile


def test_compiled_metric_objects_are_reported_as_fit_reports_them():
  """Metric objects (and per-output dicts of them) are rebuilt from the
  compile config, as a keras_hub task's `weighted_metrics`: they were
  dropped with a warning."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=(32, 5)).astype("float32")
  y = rng.randint(0, 3, 32).astype("int32")
  w = rng.uniform(size=32).astype("float32")

  def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model

  reference = build()
  want = reference.fit(x, y, sample_weight=w, batch_size=16, epochs=2,
                       shuffle=False, verbose=0).history
  model = build()
  got = Trainer(model, verbose=0).fit(x, y, sample_weight=w, epochs=2,
                                      global_batch_size=16,
                                      shuffle=False).history
  for name in ("sparse_top_k_categorical_accuracy",
               "sparse_categorical_accuracy"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6)


def test_a_model_compiled_with_per_output_losses_trains_as_its_fit():
  """A dict of losses and loss weights, as Keras keeps them after compile
  (in TF's tracking proxies, which `typing.Mapping` does not recognise):
  the Trainer refused them ("not a loss name"), under every strategy."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=(32, 5)).astype("float32")
  y = {"a": rng.randint(0, 3, 32).astype("int32"),
       "b": rng.normal(size=(32, 1)).astype("float32")}

  def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                 "b": keras.layers.Dense(1, name="b")(hidden)})
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"a": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), "b": "mse"},
        loss_weights={"a": 1.0, "b": 0.5})
    return model

  reference = build()
  want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                       verbose=0).history
  model = build()
  got = Trainer(model, verbose=0).fit(x, y, global_batch_size=16, epochs=2,
                                      shuffle=False).history
  for name in ("loss", "a_loss", "b_loss"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_weight_decay_exclusions_by_name_survive_every_copy():
  """`var_names` live outside the config too: the copies made in a
  strategy's scope, of a compiled model's optimizer and by `fuse` dropped
  them, and the refusal above points users to them."""
  from tfmgpu.training import fused  # pylint: disable=g-import-not-at-top
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(4,), num_classes=2)
  biases = [v for v in model.trainable_variables if len(v.shape) == 1]

  def adamw():
    optimizer = keras.optimizers.AdamW(weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer

  trainer = Trainer(model, strategy=strategy, optimizer=adamw(), verbose=0)
  scaled = keras.optimizers.LossScaleOptimizer(adamw())
  for copy in (trainer.optimizer, fused.fuse(adamw()),
               tfmgpu._compat.copy_optimizer(scaled).inner_optimizer):  # pylint: disable=protected-access
    assert not any(copy._use_weight_decay(v) for v in biases)  # pylint: disable=protected-access
    assert copy._use_weight_decay(model.trainable_variables[0])  # pylint: disable=protected-access


def test_a_learning_rate_given_applies_to_the_compiled_optimizer():
  """keras_hub tasks compile themselves (Adam 2e-5): Trainer(task,
  learning_rate=3e-4) trained at 2e-5, silently. The model's own optimizer
  is left as it was (the Trainer's copy stops all-reducing)."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=(16, 5)).astype("float32")
  y = rng.normal(size=(16, 1)).astype("float32")

  def build(rate):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(rate), loss="mse")
    return model

  reference = build(0.3)
  reference.fit(x, y, batch_size=16, verbose=0)
  model = build(0.01)
  own = model.optimizer
  trainer = Trainer(model, learning_rate=0.3, verbose=0)
  trainer.fit(x, y, global_batch_size=16, epochs=1)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert trainer.optimizer is not own and model.optimizer is own
  assert float(own.learning_rate) == pytest.approx(0.01)
  assert own.iterations.numpy() == 0
  with pytest.raises(ValueError, match=r"learning_rate=0.3 was given with "
                     r"optimizer=SGD\(\.\.\.\), which has its own learning "
                     r"rate \(0.01.*optimizer='adam'"):
    Trainer(build(0.01), optimizer=keras.optimizers.SGD(0.01),
            learning_rate=0.3, verbose=0)


def test_wrapped_optimizers_are_checked_one_by_one():
  """A MultiOptimizer of element-wise optimizers splits exactly (it was
  refused); one wrapping Adafactor or per-variable clipnorm does not."""
  from tfmgpu.training import optimizers  # pylint: disable=g-import-not-at-top

  def multi(inner):
    return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        default_optimizer=inner))

  assert optimizers.whole_variable_use(multi(keras.optimizers.Adam())) is None
  assert "Adafactor" in optimizers.whole_variable_use(
      multi(keras.optimizers.Adafactor()))
  assert "clipnorm=1.0" in optimizers.whole_variable_use(
      keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(clipnorm=1.0)))
  with pytest.raises(ValueError, match=r"clip_norm=2.0 with optimizer=SGD.*"
                     r"global_clipnorm=2.0, or pass an optimizer name"):
    optimizers._check_own_clipping(keras.optimizers.SGD(), 2.0)  # pylint: disable=protected-access


def _compiled(optimizer, seed=0):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
  model.compile(optimizer=optimizer, loss="mse")
  return model


def test_fused_optimizer_given_keeps_the_compiled_optimizer():
  """Any fused_optimizer= (False too) dropped a compiled model's optimizer
  for Adam 1e-3: 0.161 off its own fit with SGD 0.1."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=(16, 5)).astype("float32")
  y = rng.normal(size=(16, 1)).astype("float32")
  reference = _compiled(keras.optimizers.SGD(0.1))
  reference.fit(x, y, batch_size=16, verbose=0)
  for fused, kind in ((False, "SGD"), (True, "FusedSGD")):
    model = _compiled(keras.optimizers.SGD(0.1))
    trainer = Trainer(model, fused_optimizer=fused, verbose=0)
    trainer.fit(x, y, global_batch_size=16, epochs=1)
    assert type(trainer.optimizer).__name__ == kind
    for a, b in zip(model.get_weights(), reference.get_weights()):
      np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_compiled_optimizer_that_does_not_copy_exactly_is_not_changed():
  """The compiled optimizer's copy from config lost a subclass's argument
  (scale 3 trained as 1) and crashed on a callable learning rate."""

  class Scaled(keras.optimizers.SGD):

    def __init__(self, learning_rate=0.01, scale=1.0, **kwargs):
      super().__init__(learning_rate=learning_rate, **kwargs)
      self.scale = scale

  trainer = Trainer(_compiled(Scaled(0.1, scale=3.0)), verbose=0)
  assert trainer.optimizer.scale == 3.0
  rate = Trainer(_compiled(keras.optimizers.SGD(learning_rate=lambda: 0.05)),
                 verbose=0).optimizer.learning_rate
  assert float(rate) == pytest.approx(0.05)
  with pytest.raises(ValueError, match=r"compiled with Scaled\(\.\.\.\), "
                     r"which the Trainer must copy \(to set learning_rate=\)"
                     r", but its copy from config differs in Scaled "
                     r"scale=3.0 \(copy: 1.0\)"):
    Trainer(_compiled(Scaled(0.1, scale=3.0)), learning_rate=0.2, verbose=0)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = _compiled("sgd")
  model.compile(optimizer=Scaled(0.1, scale=3.0), loss="mse")  # Outside.
  with pytest.raises(ValueError, match=r"outside this strategy's scope and "
                     r"could not be re-created: its copy from config differs"):
    Trainer(model, strategy=strategy, verbose=0)
  # A split's Trainer would have trained the source model's own optimizer.
  source = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                             keras.layers.Dense(1)])
  source.compile(optimizer=Scaled(0.1, scale=3.0), loss="mse")
  split = tfmgpu.StagedModel.from_model(
      source, num_stages=2, devices=tfmgpu.list_devices("CPU")[:2])
  with pytest.raises(ValueError, match=r"must copy \(it belongs to the "
                     r"model a split was made from\)"):
    Trainer(split, verbose=0)


def test_multi_optimizer_copies_and_rates():
  """One optimizer under two keys is two in a copy from config: its
  exclusions moved to the wrong optimizer (paired by position). A
  learning_rate with a MultiOptimizer raised a raw AttributeError."""
  decayed = keras.optimizers.AdamW(0.01, weight_decay=0.1)
  other = keras.optimizers.AdamW(0.02, weight_decay=0.2)
  other.exclude_from_weight_decay(var_names=["bias"])
  multi = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
      other, {"a/.*": decayed, "b/.*": decayed}))
  copy = tfmgpu._compat.copy_optimizer(multi)  # pylint: disable=protected-access
  routes = tfmgpu._compat.optimizer_map(copy)  # pylint: disable=protected-access
  patterns = [getattr(o, "_exclude_from_weight_decay_pattern", None)
              for o in (routes["a/x"], routes["b/x"], routes["c"])]
  assert patterns[:2] == [None, None] and patterns[2].pattern == "bias"
  for kwargs in ({"optimizer": multi}, {}):
    with pytest.raises(ValueError, match=r"learning_rate=0.3 was given, but "
                       r".*a MultiOptimizer, whose optimizers each have "
                       r"their own learning rate"):
      Trainer(_compiled(multi), learning_rate=0.3, verbose=0, **kwargs)


def test_clip_norm_checks_the_optimizer_that_clips():
  """A LossScaleOptimizer's own global_clipnorm is its inner one's."""
  from tfmgpu.training import optimizers  # pylint: disable=g-import-not-at-top
  scaled = keras.optimizers.LossScaleOptimizer
  optimizers._check_own_clipping(  # pylint: disable=protected-access
      scaled(keras.optimizers.SGD(global_clipnorm=2.0)), 2.0)
  with pytest.raises(ValueError, match=r"its global_clipnorm: None\). "
                     r"Create it with global_clipnorm=2.0"):
    optimizers._check_own_clipping(scaled(keras.optimizers.SGD()), 2.0)  # pylint: disable=protected-access


def test_global_clipnorm_over_data_parallel_copies_is_refused():
  """Keras took the norm over both copies' equal gradients: sqrt(2) too
  large, so it clipped that much too hard (0.295 off one device)."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
      4, name="a"), keras.layers.Dense(2, name="b")])
  placed = hybrid.build_layout(model, hybrid.Layout(data=2, stages=2))
  with pytest.raises(ValueError, match=r"global_clipnorm=0.05 .* holds 2 "
                     r"data-parallel copies .* clip_norm= to tfmgpu.Trainer"):
    Trainer(placed, optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.05),
            loss="mse", verbose=0)
  Trainer(placed, optimizer="sgd", clip_norm=0.05, loss="mse", verbose=0)


class _FractionAbove(keras.metrics.Metric):
  """A user's metric whose config drops `threshold` (the base's has none)."""

  def __init__(self, threshold=0.5, name="above", **kwargs):
    super().__init__(name=name, **kwargs)
    self.threshold = threshold
    self.hits = self.add_weight(name="hits", initializer="zeros")
    self.rows = self.add_weight(name="rows", initializer="zeros")

  def update_state(self, y_true, y_pred, sample_weight=None):
    del y_true, sample_weight
    above = keras.ops.cast(y_pred[:, 0] > self.threshold, "float32")
    self.hits.assign_add(keras.ops.sum(above))
    self.rows.assign_add(keras.ops.cast(keras.ops.shape(y_pred)[0], "float32"))

  def result(self):
    return self.hits / keras.ops.maximum(self.rows, 1.0)


def _doubled_error(y_true, y_pred):
  """A plain function metric, not registered."""
  return 2.0 * keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


def test_a_compiled_metric_that_rebuilds_otherwise_is_not_reported(caplog):
  """Rebuilt from the compile config its threshold was the default: the
  Trainer reported 0.17 where fit reported 1.0. It alone is left out: a
  plain function is the user's own (its name alone was refused), and the
  others are reported."""
  keras.saving.register_keras_serializable("tests")(_FractionAbove)
  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

  model = build()
  model.compile(optimizer="sgd", loss="mse", metrics=[
      _FractionAbove(threshold=-5.0), _doubled_error, "mae"])
  x = np.ones((8, 3), "float32")
  reference = build()
  reference.compile(optimizer="sgd", loss="mse",
                    metrics=[_doubled_error, "mae"])
  want = reference.fit(x, x[:, :1], batch_size=8, verbose=0).history
  result = Trainer(model, verbose=0).fit(x, x[:, :1], global_batch_size=8)
  assert "above" not in result.history
  assert "threshold=-5.0 (copy: 0.5)" in caplog.text
  for name in ("_doubled_error", "mae"):
    np.testing.assert_allclose(result.history[name], want[name], rtol=1e-6)


def _tiny_mse(y_true, y_pred):
  """A loss whose float16 gradients underflow unless the loss is scaled."""
  error = y_true - keras.ops.cast(y_pred, "float32")
  return 1e-6 * keras.ops.mean(keras.ops.square(error), axis=-1)


def _float16_mlp():
  """A mixed_float16 MLP built as `models.build_model` builds one: the
  policy set only while building, then restored to float32."""
  keras.utils.set_random_seed(0)
  with models.dtype_policy("mixed_float16"):
    inputs = keras.Input((12,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="d1")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    return keras.Model(inputs, keras.layers.Dense(
        1, name="head", dtype="float32")(h))


@pytest.fixture(scope="module")
def float16_reference():
  """`(x, y, weights)`: Keras' compile and fit of `_float16_mlp` (a
  LossScaleOptimizer), 2 steps of 16 rows."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 12)).astype("float32")
  y = rng.normal(size=(32, 1)).astype("float32")
  reference = _float16_mlp()
  reference.compile(optimizer=keras.optimizers.SGD(1e4), loss=_tiny_mse)
  reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  return x, y, reference.get_weights()


@pytest.mark.parametrize("layout", ["staged", "pipelined", "data2_stages2"])
def test_a_float16_model_split_over_devices_scales_its_loss(
    layout, float16_reference):
  """A placed model's own layers are its stage models, built under the
  global float32 policy: the float16 check read only those, and the split
  trained with a bare SGD whose float16 gradients underflowed. Now it
  reads the layers they hold."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  x, y, expected = float16_reference
  model = _float16_mlp()
  cut = lambda: tfmgpu.plan_stages(model, 2, split_points=["d2"])
  placed = {
      "staged": lambda: tfmgpu.StagedModel(model, cut()),
      "pipelined": lambda: tfmgpu.PipelinedModel(model, cut(),
                                                 micro_batches=2),
      "data2_stages2": lambda: hybrid.build_layout(
          model, hybrid.Layout(data=2, stages=2), split_points=["d2"]),
  }[layout]()
  trainer = Trainer(placed, optimizer=keras.optimizers.SGD(1e4),
                    loss=_tiny_mse, verbose=0, metrics=[])
  assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
  trainer.fit(x, y, global_batch_size=16, epochs=1, shuffle=False)
  placed.copy_weights_to(model)
  # The weights move by 1e-2; unscaled they ended 4e-3 off, scaled 7e-6
  # (micro-batches round otherwise in float16).
  for a, b in zip(model.get_weights(), expected):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_a_float16_model_split_and_compiled_by_keras_scales_its_loss(
    float16_reference):
  """Keras' `compile` reads the placed model's own policy, the global
  float32 one it was placed under: a split float16 model compiled and fit
  as a Keras model trained with a bare SGD (its float16 gradients
  underflowed). Its compile now reads the source's, as the Trainer does,
  and `auto_scale_loss=False` still leaves the optimizer bare."""
  x, y, expected = float16_reference
  model = _float16_mlp()
  placed = tfmgpu.StagedModel(
      model, tfmgpu.plan_stages(model, 2, split_points=["d2"]))
  placed.compile(optimizer=keras.optimizers.SGD(1e4), loss=_tiny_mse,
                 auto_scale_loss=False)
  assert isinstance(placed.optimizer, keras.optimizers.SGD)
  placed.compile(optimizer=keras.optimizers.SGD(1e4), loss=_tiny_mse)
  assert isinstance(placed.optimizer, keras.optimizers.LossScaleOptimizer)
  placed.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  placed.copy_weights_to(model)
  for a, b in zip(model.get_weights(), expected):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def _float32_wrapper():
  """A float32 functional model around `_float16_mlp` (a keras_hub backbone
  in a float32 task model): Keras' compile reads the wrapper's policy."""
  inner = _float16_mlp()
  inputs = keras.Input((12,), name="x")
  return keras.Model(inputs, keras.layers.Dense(1, name="out")(inner(inputs)))


def test_a_float32_model_around_a_float16_one_is_not_loss_scaled(
    float16_reference):
  """The float16 check read every layer at any depth, so a float32 wrapper
  around a mixed_float16 sub-model got a LossScaleOptimizer that Keras'
  compile does not give it (its weights drifted from Keras'). Now it reads
  the model's own policy, as Keras does."""
  x, y, _ = float16_reference
  reference = _float32_wrapper()
  reference.compile(optimizer=keras.optimizers.SGD(1e4), loss=_tiny_mse)
  assert not isinstance(reference.optimizer,
                        keras.optimizers.LossScaleOptimizer)
  reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  model = _float32_wrapper()
  trainer = Trainer(model, optimizer=keras.optimizers.SGD(1e4),
                    loss=_tiny_mse, verbose=0, metrics=[])
  assert not isinstance(trainer.optimizer,
                        keras.optimizers.LossScaleOptimizer)
  trainer.fit(x, y, global_batch_size=16, epochs=1, shuffle=False)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
