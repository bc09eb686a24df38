"""Fused optimizers train to the weights of the Keras optimizers they replace."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import _compat
from tfmgpu import models
from tfmgpu.training import fused

STEPS = 5


def _batches():
  rng = np.random.default_rng(0)
  return [(rng.normal(size=(16, 12)).astype(np.float32),
           rng.integers(0, 4, size=16)) for _ in range(STEPS)]


def _train(strategy, make_optimizer):
  """Runs STEPS steps of the same MLP with the optimizer `make_optimizer()`
  (called in the strategy's scope); returns the weights and the optimizer."""
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(12,), num_classes=4,
                               seed=3)
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="sum")

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True)) / 16.0
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def step(x, y):
    strategy.run(replica_step, args=(x, y))

  for x, y in _batches():
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx, x=x, y=y: (
            np.split(x, ctx.num_replicas_in_sync)[ctx.replica_id_in_sync_group],
            np.split(y, ctx.num_replicas_in_sync)[ctx.replica_id_in_sync_group]))
    step(*dist)
  return model.get_weights(), optimizer


OPTIMIZERS = {
    "adam": lambda cls: cls(learning_rate=1e-2),
    "adam_no_defaults": lambda cls: cls(learning_rate=3e-3, beta_1=0.8,
                                        beta_2=0.95, epsilon=1e-5),
    "adamw": lambda cls: cls(learning_rate=1e-2, weight_decay=0.1),
    "sgd": lambda cls: cls(learning_rate=0.1),
    "momentum": lambda cls: cls(learning_rate=0.1, momentum=0.9),
    "nesterov": lambda cls: cls(learning_rate=0.1, momentum=0.9, nesterov=True),
}
KERAS_CLASS = {"adam": keras.optimizers.Adam,
               "adam_no_defaults": keras.optimizers.Adam,
               "adamw": keras.optimizers.AdamW, "sgd": keras.optimizers.SGD,
               "momentum": keras.optimizers.SGD,
               "nesterov": keras.optimizers.SGD}


# SGD's kernels repeat Keras's arithmetic exactly. Fused Adam updates the
# second moment with Keras's own ops; its kernel rounds 1 - beta_1 in float32
# where Keras rounds it in float64 (a 2.4e-7 relative difference in the
# first-moment update): after 5 steps the weights agree to 1e-6.
TOLERANCE = {"adam": 1e-6, "adam_no_defaults": 1e-6, "adamw": 1e-6}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("replicas", [1, 2])
def test_fused_equals_keras(name, replicas):
  make = OPTIMIZERS[name]
  strategy = (tfmgpu.get_strategy("one_device") if replicas == 1 else
              tfmgpu.get_strategy("mirrored", num_replicas=replicas))
  keras_class = KERAS_CLASS[name]
  ref, _ = _train(strategy, lambda: make(keras_class))
  got, optimizer = _train(strategy, lambda: fused.fuse(make(keras_class)))
  assert type(optimizer) is fused.FUSED_CLASSES[keras_class]
  init = models.build_model("mlp", input_shape=(12,), num_classes=4,
                            seed=3).get_weights()
  assert max(np.abs(r - w0).max() for r, w0 in zip(ref, init)) > 1e-3
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=0, atol=TOLERANCE.get(name, 1e-7))


def _update_op_types(optimizer) -> set[str]:
  """Op types of one traced `apply_gradients` of a small dense model."""
  model = models.build_model("mlp", input_shape=(12,), num_classes=4)
  optimizer.build(model.trainable_variables)
  fn = tf.function(lambda grads: optimizer.apply_gradients(
      zip(grads, model.trainable_variables)))
  graph = fn.get_concrete_function(
      [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
  ).graph
  return {op.type for op in graph.get_operations()}


def test_fused_update_is_one_kernel_and_amsgrad_falls_back():
  assert "ResourceApplyAdam" in _update_op_types(fused.FusedAdam(1e-2))
  assert "ResourceApplyAdam" not in _update_op_types(
      fused.FusedAdam(1e-2, amsgrad=True))
  assert "ResourceApplyKerasMomentum" in _update_op_types(
      fused.FusedSGD(0.1, momentum=0.9))
  ref, _ = _train(tfmgpu.get_strategy("one_device"),
                  lambda: keras.optimizers.Adam(1e-2, amsgrad=True))
  got, _ = _train(tfmgpu.get_strategy("one_device"),
                  lambda: fused.FusedAdam(1e-2, amsgrad=True))
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)


def test_fuse_keeps_config_and_leaves_other_optimizers_alone():
  adam = keras.optimizers.Adam(learning_rate=5e-3, beta_1=0.7)
  fused_adam = fused.fuse(adam)
  assert isinstance(fused_adam, keras.optimizers.Adam)
  assert fused_adam.get_config()["beta_1"] == pytest.approx(0.7)
  assert float(fused_adam.learning_rate) == pytest.approx(5e-3)
  rmsprop = keras.optimizers.RMSprop()
  assert fused.fuse(rmsprop) is rmsprop
  assert fused.fuse(fused_adam) is fused_adam


def test_fuse_refuses_a_built_optimizer():
  adam = keras.optimizers.Adam()
  adam.build([keras.Variable(np.zeros(3, np.float32))])
  with pytest.raises(ValueError, match="already built"):
    fused.fuse(adam)


def test_fused_optimizer_in_model_fit_and_saved_model(tmp_path):
  model = models.build_model("mlp", input_shape=(12,), num_classes=4, seed=3)
  model.compile(optimizer=fused.FusedAdam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  x, y = _batches()[0]
  model.fit(x, y, epochs=2, verbose=0)
  path = str(tmp_path / "m.keras")
  model.save(path)
  restored = keras.models.load_model(path)
  assert type(restored.optimizer) is fused.FusedAdam


@pytest.mark.parametrize("fused_optimizer", [True, False])
def test_trainer_fuses_optimizers_it_builds_by_name(fused_optimizer):
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(12,), num_classes=4)
  trainer = Trainer(model, strategy=strategy, optimizer="momentum",
                    fused_optimizer=fused_optimizer, verbose=0)
  assert (type(trainer.optimizer) is fused.FusedSGD) == fused_optimizer
  assert trainer.optimizer.momentum == pytest.approx(0.9)


def test_trainer_uses_an_optimizer_object_as_given():
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  strategy = tfmgpu.get_strategy("one_device")
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(12,), num_classes=4)
    adam = keras.optimizers.Adam(1e-3)
  assert Trainer(model, strategy=strategy, optimizer=adam,
                 verbose=0).optimizer is adam


def _adam_slots_after(optimizer, steps=3):
  """`(variable, m, v)` after `steps` updates of one variable with random
  gradients of very different sizes."""
  rng = np.random.default_rng(1)
  variable = tf.Variable(rng.normal(size=(256,)).astype(np.float32))
  optimizer.build([variable])
  for _ in range(steps):
    grad = (rng.normal(size=(256,)) * 10.0 ** rng.uniform(-6, 1, size=256))
    optimizer.apply_gradients([(tf.constant(grad, tf.float32), variable)])
  m, v = optimizer.variables[-2:]
  return variable.numpy(), m.numpy(), v.numpy()


@pytest.mark.parametrize("beta_2", [0.999, 0.95])
def test_fused_adam_moments_are_keras_to_float32_rounding(beta_2):
  """The kernel's own `1 - float32(0.999)` is 1.3e-5 (relative) from Keras's
  `1 - beta_2`; the second moment must be Keras's to the bit, the first to
  the rounding of `1 - beta_1` (2.4e-7), the weights (|w| < 4) to a
  float32 ulp."""
  ref = _adam_slots_after(keras.optimizers.Adam(1e-2, beta_2=beta_2))
  got = _adam_slots_after(fused.FusedAdam(1e-2, beta_2=beta_2))
  np.testing.assert_array_equal(got[2], ref[2])
  # m's elements can cancel to near 0: bound by the largest, not each.
  np.testing.assert_allclose(got[1], ref[1], rtol=0,
                             atol=5e-7 * np.abs(ref[1]).max())
  np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=2.5e-7)


def _residual_model(synchronized: bool) -> keras.Model:
  """Three residual blocks with (synchronized) BatchNorm: its variance is a
  difference of squares over both replicas' rows, which amplifies any
  difference in the weights."""
  L = keras.layers
  keras.utils.set_random_seed(5)
  inputs = keras.Input((8, 8, 2))
  x = L.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
  for _ in range(3):
    y = L.BatchNormalization(synchronized=synchronized)(x)
    y = L.Conv2D(16, 3, padding="same", use_bias=False)(
        L.Activation("relu")(y))
    y = L.BatchNormalization(synchronized=synchronized)(y)
    x = L.Activation("relu")(L.Add()([x, y]))
  return keras.Model(inputs, L.Dense(4)(L.GlobalAveragePooling2D()(x)))


def _lockstep_residual(strategy, steps=4):
  """`steps` steps of `_residual_model(synchronized=True)` on 2 replicas in
  lockstep: one model's gradients are applied by Keras's Adam to it and by
  `FusedAdam` to a copy of it. The model amplifies a 2e-7 (relative)
  change of the learning rate to 2.6e-3 in its weights after 4 steps (on
  a Sapphire Rapids Xeon), so two separately trained runs
  cannot tell rounding from a wrong update; the same gradient stream can.
  Returns `[(keras, fused)]` per trainable variable and its two slots."""
  with strategy.scope():
    model = _residual_model(synchronized=True)
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    ref, got = keras.optimizers.Adam(1e-2), fused.FusedAdam(1e-2)
    ref.build(model.trainable_variables)
    got.build(twin.trainable_variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="sum")

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True)) / 32.0
    grads = tape.gradient(loss, model.trainable_variables)
    ref.apply_gradients(zip(grads, model.trainable_variables))
    got.apply_gradients(zip(grads, twin.trainable_variables))

  step = tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))
  rng = np.random.default_rng(0)
  for _ in range(steps):
    x = rng.normal(size=(32, 8, 8, 2)).astype(np.float32)
    y = rng.integers(0, 4, size=32)
    step(*strategy.experimental_distribute_values_from_function(
        lambda ctx, x=x, y=y: (np.split(x, 2)[ctx.replica_id_in_sync_group],
                               np.split(y, 2)[ctx.replica_id_in_sync_group])))
  pairs = []
  for a, b in zip(model.trainable_variables, twin.trainable_variables):
    slots = zip(_compat.adam_slots(ref, a),
                _compat.adam_slots(got, b))
    pairs.append([(a.numpy(), b.numpy())]
                 + [(s.numpy(), t.numpy()) for s, t in slots])
  return pairs


def test_fused_adam_is_keras_adam_under_synchronized_batchnorm():
  """Mirrored x2, a residual model with synchronized BatchNorm, the same 4
  steps of gradients: the fused weights stay within float32 rounding of
  Keras's (measured 1.2e-7 here), the second moment is Keras's to 1e-6
  (relative; the kernel's own `1 - float32(0.999)` is 1.3e-5 off)."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  for (w, fw), (m, fm), (v, fv) in _lockstep_residual(strategy):
    np.testing.assert_allclose(fw, w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(fm, m, rtol=0, atol=1e-6 * np.abs(m).max())
    np.testing.assert_allclose(fv, v, rtol=1e-6, atol=0)
