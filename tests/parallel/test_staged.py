"""StagedModel: parity with unsplit training, placement read from the traced graph."""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.models import demo
from tfmgpu.parallel import inspection
from tfmgpu.parallel import partition
from tfmgpu.parallel import placed
from tfmgpu.parallel import staged as staged_lib

StagedModel = staged_lib.StagedModel

LR = 0.01
STEPS = 4
BATCH = 8
# Ops that carry no device of their own: captured variable handles and
# variable reads, which TF colocates with the variable's resource.
RESOURCE_OPS = {"Placeholder", "ReadVariableOp", "VarHandleOp"}


def _mlp(seed=0):
  """A chain with weight and activity regularisers and a BatchNorm."""
  keras.utils.set_random_seed(seed)
  L = keras.layers
  return keras.Sequential([
      keras.Input((12,)),
      L.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(
          1e-2), name="d0"),
      L.BatchNormalization(name="bn"),
      L.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(
          1e-3), name="d1"),
      L.Dense(16, activation="tanh", name="d2"),
      L.Dense(3, kernel_regularizer=keras.regularizers.L2(1e-2), name="logits"),
  ], name="mlp")


def _resnet(seed=0):
  keras.utils.set_random_seed(seed)
  return demo.small_resnet((8, 8, 3), 3, blocks=3, filters=4)


def _lstm(seed=0):
  """Stages whose forward and backward are while loops (nested functions)."""
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((5, 3)),
      keras.layers.LSTM(4, return_sequences=True, name="lstm_a"),
      keras.layers.LSTM(4, name="lstm_b"),
      keras.layers.Dense(3, name="logits"),
  ], name="lstm")


def _data(model, n=STEPS * BATCH):
  rng = np.random.RandomState(1)
  x = rng.randn(n, *model.input_shape[1:]).astype("float32")
  y = rng.randint(0, 3, size=(n,))
  return x, y


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _assert_same_weights(a: keras.Model, b: keras.Model):
  wa, wb = a.get_weights(), b.get_weights()
  assert len(wa) == len(wb)
  for i, (u, v) in enumerate(zip(wa, wb)):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5, err_msg=f"weight {i}")


# ------------------------------------------------------------------ parity


# K=2 trains through the same hook in the custom loop below; 4 and 3 stages
# (middle stages) here.
@pytest.mark.parametrize("build,num_stages", [(_mlp, 4), (_resnet, 3)])
def test_fit_matches_unsplit_training(build, num_stages):
  model = build()
  x, y = _data(model)
  staged = StagedModel.from_model(model, num_stages=num_stages)
  assert staged.plan.num_stages == num_stages
  assert len(set(staged.stage_devices)) == num_stages
  staged.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  model.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  got = staged.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  want = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

  assert staged.optimizer.iterations.numpy() == STEPS
  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  _assert_same_weights(staged.to_unsplit(), model)  # Includes BN statistics.
  np.testing.assert_allclose(staged.evaluate(x, y, verbose=0),
                             model.evaluate(x, y, verbose=0), rtol=1e-5)


def _manual_losses(model, x, y, staged=None):
  """A custom loop: the staged hook, or one tape on the unsplit model."""
  loss_obj = _loss()
  optimizer = keras.optimizers.Adam(LR)
  if staged is not None:
    staged.build_optimizer(optimizer)
    variables = staged.trainable_variables
  else:
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables

  @tf.function
  def step(xb, yb):
    if staged is not None:
      loss, _, grads = staged.compute_loss_and_gradients(xb, yb, loss_obj)
    else:
      with tf.GradientTape() as tape:
        y_pred = model(xb, training=True)
        loss = loss_obj(yb, y_pred) + tf.add_n(model.losses)
      grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))
    return loss

  return [float(step(x[i:i + BATCH], y[i:i + BATCH]))
          for i in range(0, len(x), BATCH)]


def test_custom_loop_matches_unsplit_training():
  """K=2 (4 stages: `fit` above, through the same hook)."""
  model = _mlp()
  x, y = _data(model)
  staged = StagedModel.from_model(model, num_stages=2)
  got = _manual_losses(None, x, y, staged=staged)
  want = _manual_losses(model, x, y)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  _assert_same_weights(staged.to_unsplit(), model)


def test_gradients_are_in_trainable_variables_order():
  model = _mlp()
  x, y = _data(model, BATCH)
  staged = StagedModel.from_model(model, num_stages=3)
  _, y_pred, grads = staged.compute_loss_and_gradients(x, y, _loss())
  np.testing.assert_allclose(y_pred, model(x, training=True), rtol=1e-5,
                             atol=1e-6)
  with tf.GradientTape() as tape:
    loss = _loss()(y, model(x, training=True)) + tf.add_n(model.losses)
  key = lambda v: "/".join(v.path.split("/")[-2:])  # layer/weight
  want = dict(zip([key(v) for v in model.trainable_variables],
                  tape.gradient(loss, model.trainable_variables)))
  assert [key(v) for v in staged.trainable_variables] == list(want)
  for v, g in zip(staged.trainable_variables, grads):
    np.testing.assert_allclose(g, want[key(v)], rtol=1e-5, atol=1e-6,
                               err_msg=v.path)


# --------------------------------------------------------------- placement

_STAGE = re.compile(r"^stage_(\d+)(_backward)?(?:_\d+)?$")


def _ops_by_stage(placements):
  """{(stage, "forward" | "backward"): [OpPlacement]} from name scopes."""
  out = collections.defaultdict(list)
  for p in placements:
    parts = p.name.split("/")
    for i, part in enumerate(parts):
      m = _STAGE.match(part)
      if m:
        backward = bool(m.group(2)) or "gradient_tape" in parts[:i]
        out[(int(m.group(1)), "backward" if backward else "forward")].append(p)
        break
  return out


def _misplaced(staged, placements):
  """Stage ops not on their stage's device; checks none of the sets is empty."""
  by_stage = _ops_by_stage(placements)
  bad = []
  for k, device in enumerate(staged.stage_devices):
    for kind in ("forward", "backward"):
      ops = by_stage[(k, kind)]
      assert any(p.type in ("MatMul", "Conv2D", "While") for p in ops), (
          f"no {kind} compute op found for stage {k}")
      bad += [(k, kind, p.name, p.device) for p in ops if p.device != device
              and not (p.device == "" and p.type in RESOURCE_OPS)]
  return bad


def _fit_step(staged, x, y):
  fn = tf.function(lambda xb, yb: staged.train_step((xb, yb)))
  return fn.get_concrete_function(tf.TensorSpec(x[:BATCH].shape),
                                  tf.TensorSpec(y[:BATCH].shape, tf.int64))


def _custom_step(staged, x, y):
  optimizer = staged.optimizer

  def step(xb, yb):
    loss, _, grads = staged.compute_loss_and_gradients(xb, yb, _loss())
    optimizer.apply_gradients(zip(grads, staged.trainable_variables))
    return loss

  return tf.function(step).get_concrete_function(
      tf.TensorSpec(x[:BATCH].shape), tf.TensorSpec(y[:BATCH].shape, tf.int64))


def _single_tape_step(staged, x, y):
  """The bug this package exists to fix: one tape, backward on device 0."""
  optimizer = staged.optimizer

  def step(xb, yb):
    with tf.device(staged.stage_devices[0]):
      with tf.GradientTape() as tape:
        loss = _loss()(yb, staged(xb, training=True))
      grads = tape.gradient(loss, staged.trainable_variables)
    optimizer.apply_gradients(zip(grads, staged.trainable_variables))
    return loss

  return tf.function(step).get_concrete_function(
      tf.TensorSpec(x[:BATCH].shape), tf.TensorSpec(y[:BATCH].shape, tf.int64))


@pytest.mark.parametrize("build", [_mlp, _lstm])
@pytest.mark.parametrize("make_step", [_fit_step, _custom_step])
def test_every_stage_op_and_update_runs_on_its_device(build, make_step,
                                                      cpu_devices):
  model = build()
  x, y = _data(model)
  staged = StagedModel.from_model(model, num_stages=3, devices=cpu_devices[1:])
  staged.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  placements = inspection.op_placements(make_step(staged, x, y))

  assert _misplaced(staged, placements) == []
  # The optimizer's per-variable update math runs beside the variable: Adam
  # squares each gradient once.
  squares = collections.Counter(p.device for p in placements
                                if p.name.startswith(staged.optimizer.name + "/")
                                and p.type == "Square")
  want = collections.Counter()
  for stage, device in zip(staged.stages, staged.stage_devices):
    want[device] += len(stage.trainable_variables)
  assert squares == want


def test_single_tape_backward_is_detected_as_misplaced(cpu_devices):
  model = _mlp()
  x, y = _data(model)
  staged = StagedModel.from_model(model, num_stages=3, devices=cpu_devices[1:])
  staged.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  bad = _misplaced(staged, inspection.op_placements(
      _single_tape_step(staged, x, y)))
  # Forward ops stay on their stages (the call is placed), but the backward
  # of stages 1 and 2 lands on the tape's device, stage 0's.
  assert {(k, kind) for k, kind, _, _ in bad} == {(1, "backward"),
                                                  (2, "backward")}
  assert {device for *_, device in bad} == {staged.stage_devices[0]}


def test_each_device_holds_only_its_stage_weights_and_slots(cpu_devices):
  model = _mlp()
  staged = StagedModel.from_model(model, num_stages=3, devices=cpu_devices[1:])
  staged.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  x, y = _data(model)
  staged.fit(x, y, batch_size=BATCH, verbose=0)  # Slots exist after fit.
  optimizer = staged.optimizer
  held = collections.defaultdict(set)
  nbytes = collections.Counter()
  for v in list(staged.variables) + list(optimizer.variables):
    device = devices_lib.canonical_device(placed.variable_device(v))
    held[device].add(v.path)
    nbytes[device] += int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize

  prefix = optimizer.name
  assert held[cpu_devices[0]] == {f"{prefix}/iteration",
                                  f"{prefix}/learning_rate"}
  estimate = staged.plan.memory_estimate(BATCH, optimizer="adam")
  for stage, sub, device in zip(staged.plan.stages, staged.stages,
                                staged.stage_devices):
    slots = {f"{prefix}/{v.path.replace('/', '_')}_{kind}"
             for v in sub.trainable_variables
             for kind in ("momentum", "velocity")}
    assert held[device] == {v.path for v in sub.variables} | slots
    assert {p.split("/")[0] for p in held[device] - slots} == set(stage.layers)
    # The plan's byte counts are what the device really holds.
    assert nbytes[device] == (estimate[device].weights +
                              estimate[device].optimizer_slots)


# ------------------------------------------------------------------ weights


def test_weights_move_both_ways_with_identical_outputs(tmp_path):
  model = _mlp()
  x, y = _data(model)
  calls = lambda: [len(l._inbound_nodes) for l in model.layers]  # pylint: disable=protected-access
  before = calls()
  staged = StagedModel.from_model(model, num_stages=4)
  assert calls() == before  # Splitting leaves the user's model untouched.
  np.testing.assert_array_equal(staged.predict(x, verbose=0),
                                model.predict(x, verbose=0))

  # Train split, serve unsplit.
  staged.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  staged.fit(x, y, batch_size=BATCH, verbose=0)
  served = staged.to_unsplit(device="/cpu:0")
  assert {placed.variable_device(v) for v in served.variables} == {
      "/job:localhost/replica:0/task:0/device:CPU:0"}
  np.testing.assert_array_equal(served.predict(x, verbose=0),
                                staged.predict(x, verbose=0))
  staged.copy_weights_to(model)
  _assert_same_weights(model, served)

  # Train unsplit, load into the split model.
  model.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  model.fit(x, y, batch_size=BATCH, verbose=0)
  staged.load_from(model)
  np.testing.assert_array_equal(staged.predict(x, verbose=0),
                                model.predict(x, verbose=0))

  # Keras weight files round-trip, into a fresh staged model.
  path = str(tmp_path / "staged.weights.h5")
  staged.save_weights(path)
  other = StagedModel.from_model(_mlp(seed=5), staged.plan)
  assert not np.allclose(other.predict(x, verbose=0),
                         staged.predict(x, verbose=0))
  other.load_weights(path)
  np.testing.assert_array_equal(other.predict(x, verbose=0),
                                staged.predict(x, verbose=0))


def test_functional_model_unsplits_again_and_exports(tmp_path):
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  model = _resnet()
  x, _ = _data(model)
  want = model.predict(x, verbose=0)
  staged = StagedModel.from_model(model, num_stages=3)
  # Keras' Functional.from_config consumes the config it is given: every
  # call must rebuild from an intact one.
  for _ in range(2):
    np.testing.assert_allclose(staged.to_unsplit().predict(x, verbose=0), want,
                               rtol=1e-5, atol=1e-5)
  # The README's sequence: unsplit, then export the staged model.
  path = inference.export_saved_model(staged, str(tmp_path / "sm"))
  served = inference.load_model(path)
  np.testing.assert_allclose(inference.predict(served, x), want, rtol=1e-5,
                             atol=1e-5)


class _Scaled(keras.layers.Layer):
  """A user's layer as Keras examples write them: no get_config, no name
  given, so Keras names it, and its automatic config holds no name (Keras
  keeps the name only when the catch-all argument is called `kwargs`)."""

  def __init__(self, units, **kw):
    super().__init__(**kw)
    self.dense = keras.layers.Dense(units)

  def build(self, input_shape):
    self.dense.build(input_shape)

  def call(self, x):
    return self.dense(x) * 0.5


def test_a_custom_layer_named_by_keras_keeps_its_name_when_split():
  keras.utils.set_random_seed(2)
  inputs = keras.Input((6,))
  h = _Scaled(8)(inputs)
  h = keras.layers.Dense(8, activation="relu")(h)
  outputs = _Scaled(3)(h)
  model = keras.Model(inputs, outputs)
  x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
  want = model.predict(x, verbose=0)
  staged = StagedModel.from_model(model, num_stages=2)
  np.testing.assert_allclose(staged.predict(x, verbose=0), want, rtol=1e-6,
                             atol=1e-6)
  rebuilt = staged.to_unsplit(custom_objects={"_Scaled": _Scaled})
  assert [l.name for l in rebuilt.layers] == [l.name for l in model.layers]
  np.testing.assert_allclose(rebuilt.predict(x, verbose=0), want, rtol=1e-6,
                             atol=1e-6)


class _Gain(keras.layers.Layer):
  """Scales by `gain`; its config drops `gain` (as keras_hub 0.32's
  `MixtralTransformerDecoder` drops `router_aux_loss_coef`)."""

  def __init__(self, gain=1.0, **kwargs):
    super().__init__(**kwargs)
    self.gain = gain

  def call(self, x):
    return x * self.gain

  def get_config(self):
    return {"name": self.name}


class _DoubledGain(_Gain):
  """The same, keeping twice its argument: no copy keeps what it keeps."""

  def __init__(self, gain=1.0, **kwargs):
    super().__init__(gain=2 * gain, **kwargs)


def _gain_model(layer_cls):
  inputs = keras.Input((4,))
  h = keras.layers.Dense(4, name="d0")(inputs)
  outputs = layer_cls(gain=3.0, name="gain")(h)
  return keras.Model(inputs, keras.layers.Dense(2, name="d1")(outputs))


def test_a_layer_whose_config_drops_an_argument_is_copied_from_it():
  """Split by config alone, the copy scaled by 1.0 instead of 3.0 and the
  staged model predicted (and trained) another model, with no error."""
  keras.utils.set_random_seed(3)
  model = _gain_model(_Gain)
  x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
  staged = StagedModel.from_model(model, num_stages=2)
  np.testing.assert_allclose(staged.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-6)


def test_a_layer_no_copy_can_keep_is_refused_by_name():
  keras.utils.set_random_seed(3)
  with pytest.raises(ValueError, match=r"'gain' \(_DoubledGain\).*"
                     r"copy differs in"):
    StagedModel.from_model(_gain_model(_DoubledGain), num_stages=2)


# ------------------------------------------------------------------- errors


def test_plan_for_another_model_is_rejected():
  plan = partition.plan_stages(_mlp(), 2)
  with pytest.raises(ValueError, match=r"plan was made for layers .*d0"):
    StagedModel(demo.deep_mlp((12,), 3, depth=2, width=4), plan)


def test_jit_compile_is_rejected():
  staged = StagedModel.from_model(_mlp(), num_stages=2)
  with pytest.raises(ValueError, match=r"jit_compile=True is not supported"):
    staged.compile(optimizer="adam", loss=_loss(), jit_compile=True)


def test_fit_without_a_loss_says_to_compile_with_one():
  model = _mlp()
  x, y = _data(model)
  staged = StagedModel.from_model(model, num_stages=2)
  staged.compile(optimizer="adam")
  with pytest.raises(ValueError, match=r"compile\(loss=\.\.\.\)"):
    staged.fit(x, y, verbose=0)


def test_plan_and_options_together_are_rejected():
  model = _mlp()
  plan = partition.plan_stages(model, 2)
  with pytest.raises(ValueError, match=r"either plan=.* or num_stages"):
    StagedModel.from_model(model, plan, num_stages=2)


def test_save_writes_the_unsplit_model(tmp_path):
  """`placed.save(path)` raised a bare NotImplementedError from Keras."""
  model = _mlp()
  staged = StagedModel.from_model(model, num_stages=2)
  staged.save(str(tmp_path / "m.keras"))
  loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
  x = np.random.default_rng(0).normal(size=(4, 12)).astype(np.float32)
  np.testing.assert_allclose(loaded.predict(x, verbose=0),
                             staged.predict(x, verbose=0), atol=1e-6)


def test_lost_arguments_compares_what_it_can_and_skips_what_fails():
  """An int against a list raised TypeError; a property that raises broke
  the copy of a layer that had nothing lost."""

  class Odd(keras.layers.Layer):

    def __init__(self, sizes=(1, 2), width=3, broken=0, **kwargs):
      del broken  # Read back through a property that fails.
      super().__init__(**kwargs)
      self.sizes, self.width = sizes, width

    @property
    def broken(self):
      raise RuntimeError("not built")

  assert checks.lost_arguments(Odd(sizes=[1, 2]), Odd(sizes=(1, 2))) == []
  assert checks.lost_arguments(Odd(sizes=4), Odd(sizes=[4])) == [
      "sizes=4 (copy: [4])"]
  assert checks.lost_arguments(Odd(width=3), Odd(width=5)) == [
      "width=3 (copy: 5)"]


class _Scaled(keras.layers.Layer):
  """Keeps its argument under another name, which its config drops."""

  def __init__(self, units=4, alpha=1.0, **kwargs):
    super().__init__(**kwargs)
    self.units, self._scale = units, alpha * 2.0

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], self.units))

  def call(self, x):
    return keras.ops.matmul(x, self.kernel) * self._scale

  def get_config(self):
    return {**super().get_config(), "units": self.units}


def test_a_layer_whose_copy_computes_otherwise_is_refused():
  """Its copy got alpha=1.0: predictions 0.79 off, training another model,
  without a word (a new user's layer)."""
  x = keras.Input((6,))
  h = _Scaled(4, alpha=0.2, name="scaled")(keras.layers.Dense(6, name="a")(x))
  model = keras.Model(x, keras.layers.Dense(2, name="out")(
      keras.layers.Dense(4, name="b")(h)))
  with pytest.raises(ValueError, match=r"layer 'scaled' \(_Scaled\) does "
                     r"not rebuild as it is: its copy differs in _scale=0\.4 "
                     r"\(copy: 2\.0\)"):
    StagedModel.from_model(model, num_stages=2)


class _NoConfig(keras.layers.Layer):
  """Keeps its arguments under their names; its get_config raises."""

  def __init__(self, units=4, **kwargs):
    super().__init__(**kwargs)
    self.units = units

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], self.units))

  def call(self, x):
    return keras.ops.matmul(x, self.kernel)

  def get_config(self):
    raise NotImplementedError


def test_a_layer_whose_get_config_raises_splits_and_to_unsplit_says_why():
  """A bare NotImplementedError came out of StagedModel.from_model."""
  x = keras.Input((6,))
  h = _NoConfig(4, name="plain")(keras.layers.Dense(6, name="a")(x))
  model = keras.Model(x, keras.layers.Dense(2, name="out")(
      keras.layers.Dense(4, name="b")(h)))
  staged = StagedModel.from_model(model, num_stages=2)
  rows = np.ones((3, 6), "float32")
  np.testing.assert_allclose(staged.predict(rows, verbose=0),
                             model.predict(rows, verbose=0), rtol=1e-6)
  with pytest.raises(ValueError, match=r"cannot be rebuilt: a layer's "
                     r"get_config\(\) raises NotImplementedError"):
    staged.to_unsplit()


class _TiedHead(keras.layers.Layer):
  """A hand-written tied output: holds the Embedding layer (no config)."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, h):
    return keras.ops.matmul(h, keras.ops.transpose(
        self.embedding.embeddings))


def test_a_head_holding_the_embedding_layer_splits_without_touching_it():
  """The copy held the user's Embedding: the tie swapped its variable for
  the split's (fresh values: predictions 0.007 off, the user's model
  changed and trained by the split)."""
  keras.utils.set_random_seed(0)
  ids = keras.Input((5,), dtype="int32")
  embedding = keras.layers.Embedding(12, 8, name="emb")
  h = keras.layers.Dense(8, activation="tanh", name="mid")(embedding(ids))
  model = keras.Model(ids, _TiedHead(embedding, name="tied")(
      keras.layers.Dense(8, activation="tanh", name="mid2")(h)))
  rows = np.random.default_rng(0).integers(0, 12, (16, 5)).astype("int32")
  want, variable = model.predict(rows, verbose=0), embedding.embeddings
  staged = StagedModel(model, partition.plan_stages(
      model, 2, split_points=["mid2"]))
  np.testing.assert_allclose(staged.predict(rows, verbose=0), want,
                             atol=1e-6)
  staged.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.
                 SparseCategoricalCrossentropy(from_logits=True))
  staged.fit(rows, rows, batch_size=16, epochs=1, verbose=0)
  assert embedding.embeddings is variable
  np.testing.assert_array_equal(model.predict(rows, verbose=0), want)
  served = tfmgpu.predict(model, rows, strategy="mirrored")  # A copy.
  np.testing.assert_allclose(served, want, atol=1e-6)


_SCALE = 3.0


def test_a_lambda_reading_the_users_globals_splits():
  """Its copy from config ran the lambda with Keras' globals: `keras`,
  `_SCALE` unknown (a shape-inference error, then a NameError)."""
  x = keras.Input((6,))
  h = keras.layers.Lambda(lambda t: keras.ops.tanh(t) * _SCALE, name="lam")(
      keras.layers.Dense(8, name="a")(x))
  model = keras.Model(x, keras.layers.Dense(3, name="out")(
      keras.layers.Dense(8, name="b")(h)))
  staged = StagedModel(model, partition.plan_stages(
      model, 2, split_points=["b"]))
  rows = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
  np.testing.assert_allclose(staged.predict(rows, verbose=0),
                             model.predict(rows, verbose=0), atol=1e-6)


def test_a_masked_input_crosses_stages_without_keras_false_warning():
  """A new user's trial: Keras warned, once per stage and micro-batch, that
  the stage "will destroy the mask information", while the stage's own
  layers carried it (the predictions equal the unsplit model's)."""
  import warnings  # pylint: disable=g-import-not-at-top
  ids = keras.Input((6,), dtype="int32")
  h = keras.layers.Embedding(20, 8, mask_zero=True, name="emb")(ids)
  h = keras.layers.LSTM(8, name="lstm")(keras.layers.Dense(8, name="d")(h))
  model = keras.Model(ids, keras.layers.Dense(3, name="out")(h))
  rows = np.array([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0]], "int32")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    staged = StagedModel(model, partition.plan_stages(
        model, 2, split_points=["lstm"]))
    got = staged.predict(rows, verbose=0)
  np.testing.assert_allclose(got, model.predict(rows, verbose=0), atol=1e-6)
  unmasked = model.predict(np.where(rows > 0, rows, 7), verbose=0)
  assert np.abs(got - unmasked).max() > 1e-3  # The mask mattered.
  said = [str(w.message) for w in caught if "destroy the mask" in str(
      w.message)]
  assert not said, said


class _ScaledModel(keras.Model):
  """A functional model whose own call() adds to its graph."""

  def __init__(self, **kwargs):
    x = keras.Input((6,))
    super().__init__(x, keras.layers.Dense(6, name="inner_dense")(x),
                     **kwargs)

  def call(self, inputs, training=None):
    return 3.0 * super().call(inputs, training=training) + 1.0


def test_a_functional_model_overriding_call_is_refused_or_kept_whole():
  """Its graph was split and its call() dropped: predictions 4.5 off."""
  with pytest.raises(ValueError, match=r"'scaled' \(_ScaledModel\) overrides "
                     r"call\(\): a split replays the graph"):
    StagedModel.from_model(_ScaledModel(name="scaled"), num_stages=2)
  x = keras.Input((6,))
  h = _ScaledModel(name="inner")(keras.layers.Dense(6, name="pre")(x))
  model = keras.Model(x, keras.layers.Dense(2, name="post")(h))
  staged = StagedModel(model, partition.plan_stages(
      model, 2, split_points=["inner"]))  # Nested: called whole.
  rows = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
  np.testing.assert_allclose(staged.predict(rows, verbose=0),
                             model.predict(rows, verbose=0), atol=1e-6)


def test_a_nested_model_called_with_inputs_as_a_keyword_is_cut_inside():
  """keras_hub's Gemma3CausalLM calls `backbone(inputs=...)`: the backbone
  was kept whole on one stage (the other held only the head)."""
  x = keras.Input((6,))
  h = keras.layers.Dense(6, name="d1")(x)
  inner = keras.Model(x, keras.layers.Dense(6, name="d2")(h), name="inner")
  outer_in = keras.Input((6,))
  model = keras.Model(outer_in, keras.layers.Dense(2, name="head")(
      inner(inputs=outer_in)))
  plan = partition.plan_stages(model, 2, split_points=["d2"])
  assert plan.stages[0].layers == ("d1",), plan
  staged = StagedModel(model, plan)
  rows = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
  np.testing.assert_allclose(staged.predict(rows, verbose=0),
                             model.predict(rows, verbose=0), atol=1e-6)


def test_unfreezing_the_model_after_splitting_it_is_refused():
  """keras.io's fine-tuning: `base.trainable = True` on the model after it
  was split changed nothing the split trains (the base moved by 0.0)."""
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  x = keras.Input((6,))
  base = keras.layers.Dense(6, name="base")
  base.trainable = False
  h = keras.layers.Dense(6, name="mid")(base(x))
  model = keras.Model(x, keras.layers.Dense(2, name="head")(h))
  staged = StagedModel(model, partition.plan_stages(
      model, 2, split_points=["mid"]))
  base.trainable = True
  with pytest.raises(ValueError, match=r"was split into StagedModel .* and "
                     r"then changed which weights train \(base/kernel, "
                     r"base/bias\).*split the model again"):
    staged.compile(optimizer="sgd", loss="mse")
  with pytest.raises(ValueError, match=r"then changed which weights train"):
    Trainer(staged, loss="mse")


class _L2Step(keras.Model):
  """A keras.io-style model whose own train_step adds a penalty."""

  def train_step(self, data):
    return super().train_step(data)


class _OwnLoss(keras.Model):

  def compute_loss(self, *args, **kwargs):
    return super().compute_loss(*args, **kwargs)


@pytest.mark.parametrize("cls,step", [(_L2Step, "train_step"),
                                      (_OwnLoss, "compute_loss")])
def test_a_model_with_its_own_keras_step_is_refused_by_every_split(
    cls, step, cpu_devices):
  """A split runs its own per-device steps: the user's would silently not
  run (a custom train_step's penalty was dropped: weight norm 28.7 against
  0.81 unsplit)."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel.branches import BranchParallel  # pylint: disable=g-import-not-at-top

  def make():
    x = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu", name="h")(x)
    return cls(x, keras.layers.Dense(4, name="out")(h), name="mine")

  model, twin = make(), make()
  twin.set_weights(model.get_weights())
  splits = {
      "staged": lambda: StagedModel.from_model(model, num_stages=2),
      "pipelined": lambda: pipeline.PipelinedModel.from_model(
          model, num_stages=2, micro_batches=2),
      "tensor": lambda: tensor.TensorParallelModel(model, cpu_devices[:2]),
      "hybrid": lambda: hybrid.build_layout(
          model, hybrid.Layout(data=2, stages=2), devices=cpu_devices),
      "zero": lambda: zero.ShardedModel(model, cpu_devices[:2]),
      "branches": lambda: BranchParallel([model], devices=cpu_devices[1:2])}
  for split in splits.values():
    with pytest.raises(ValueError, match=rf"(model|branches\[0\]) 'mine' "
                       rf"\({cls.__name__}\) "
                       rf"overrides {step}: a split or sharded model .*"
                       "add_loss"):
      split()
  # What the error offers for serving: a plain functional view splits, and
  # serving placements split one themselves (serving runs no training step).
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  x = np.random.RandomState(0).normal(size=(4, 8)).astype("float32")
  want = model.predict(x, verbose=0)
  view = StagedModel.from_model(keras.Model(model.input, model.output),
                                num_stages=2)
  served, _ = inference.place_for_serving([model], "model_parallel",
                                          num_stages=2)
  towers, _ = inference.place_for_serving([model, twin], "branch_parallel")
  for split in (view, served, towers):
    np.testing.assert_allclose(split.predict(x, verbose=0), want, rtol=1e-6)
  assert checks.overridden_steps(_mlp()) == []


def test_a_model_with_stateful_rnns_is_refused_by_every_split(cpu_devices):
  """Keras keeps a stateful RNN's state outside its weights: ZeRO ran the
  model without it (weights 3.4e-3 off Keras on one device, predict 0.4
  off), the splits failed deep in Keras ("the batch size must be
  static"). Refused when made, naming the layer and what runs it."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero  # pylint: disable=g-import-not-at-top
  x = keras.Input(batch_shape=(8, 5, 4))
  h = keras.layers.Dense(6, name="pre")(x)
  h = keras.layers.Bidirectional(keras.layers.LSTM(
      6, stateful=True, name="lstm"), name="both_ways")(h)
  model = keras.Model(x, keras.layers.Dense(3, name="head")(h), name="rnn")
  splits = {
      "StagedModel": lambda: StagedModel.from_model(model, num_stages=2),
      "PipelinedModel": lambda: pipeline.PipelinedModel.from_model(
          model, num_stages=2, micro_batches=2),
      "TensorParallelModel": lambda: tensor.TensorParallelModel(
          model, cpu_devices[:2]),
      "the layout data 2": lambda: hybrid.build_layout(
          model, hybrid.Layout(data=2, stages=2), devices=cpu_devices),
      r"ZeRO \(ShardedModel, stage 1": lambda: zero.ShardedModel(
          model, cpu_devices[:1], stage=1)}
  for layout, split in splits.items():
    with pytest.raises(ValueError, match=(
        r"model 'rnn' has stateful RNN layers \('both_ways': stateful=True"
        rf"\), which cannot run .*{layout}.*run on one device.*"
        "initial_state")):
      split()


def test_weight_files_move_between_layouts_and_the_unsplit_model(
    tmp_path, cpu_devices):
  """A layout's `save_weights` (what Keras' ModelCheckpoint with
  save_weights_only=True calls) writes the unsplit model's weights: the
  unsplit model and other layouts load them (the file held the stages'
  structure, which nothing else loaded)."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  x = np.random.RandomState(0).normal(size=(8, 12)).astype("float32")
  staged = StagedModel.from_model(_mlp(seed=1), num_stages=2)
  want = staged.predict(x, verbose=0)
  staged.save_weights(str(tmp_path / "staged.weights.h5"))
  unsplit = _mlp(seed=2)
  unsplit.load_weights(str(tmp_path / "staged.weights.h5"))
  copies = hybrid.build_layout(_mlp(seed=3), hybrid.Layout(data=2, stages=2),
                               devices=cpu_devices)
  others = [pipeline.PipelinedModel.from_model(_mlp(seed=3), num_stages=3,
                                               micro_batches=2), copies]
  for other in others:
    other.load_weights(str(tmp_path / "staged.weights.h5"))
  for model in [unsplit, *others]:
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                               want, rtol=1e-5, atol=1e-6)


def test_lookup_layers_keep_their_vocabulary_in_every_copy(cpu_devices):
  """A TextVectorization / StringLookup copied from its config had an
  empty table ("Table not initialized"): splits, to_unsplit and mirrored
  serving's copy failed on text models."""
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  texts = np.array([["the good plot"], ["a bad actor"], ["good good"],
                    ["bad plot"]])
  vectorize = keras.layers.TextVectorization(max_tokens=12,
                                             output_sequence_length=4)
  vectorize.adapt(texts[:, 0])
  words = keras.layers.StringLookup(name="words")
  words.adapt(np.array(["good", "bad"]))
  text, word = keras.Input((1,), dtype="string"), keras.Input((1,), dtype="string")
  h = keras.layers.Embedding(12, 4, name="emb")(vectorize(text))
  h = keras.layers.Concatenate(name="join")([
      keras.layers.GlobalAveragePooling1D(name="pool")(h),
      keras.layers.CategoryEncoding(4, "multi_hot", name="onehot")(
          words(word))])
  model = keras.Model([text, word], keras.layers.Dense(2, name="out")(
      keras.layers.Dense(4, activation="relu", name="hidden")(h)))
  x = [tf.constant(texts), tf.constant([["good"], ["bad"], ["meh"], ["good"]])]
  want = model.predict(x, verbose=0)
  staged = StagedModel.from_model(model, num_stages=2)
  for got in (staged.predict(x, verbose=0),
              staged.to_unsplit().predict(x, verbose=0),
              inference.predict(model, x, strategy="mirrored", batch_size=2)):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_adapted_statistics_hold_in_every_copy(cpu_devices, tmp_path):
  """An adapted Normalization divides by constants Keras computes from its
  weights in `finalize_state()`, which `set_weights` never calls: every
  copy (a split, `to_unsplit`, mirrored serving's copy, the exported
  SavedModel) kept the zero mean it was built with (predictions 6.8 off).
  A Discretization's boundaries (its config's) stay as adapted: calling
  its `finalize_state()` on a copy would empty them."""
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = [(rng.normal(size=(10, 4)) * 3 + 5).astype("float32"),
       rng.normal(size=(10, 1)).astype("float32")]
  keras.utils.set_random_seed(0)
  norm = keras.layers.Normalization(name="norm")
  norm.adapt(x[0])
  bins = keras.layers.Discretization(num_bins=4, output_mode="one_hot",
                                     name="bins")
  bins.adapt(x[1])
  a, b = keras.Input((4,), name="a"), keras.Input((1,), name="b")
  h = keras.layers.Concatenate(name="join")([norm(a), bins(b)])
  model = keras.Model([a, b], keras.layers.Dense(2, name="out")(
      keras.layers.Dense(8, activation="relu", name="hidden")(h)))
  want = model.predict(x, verbose=0)
  staged = StagedModel.from_model(model, num_stages=2)
  copied_back = keras.models.clone_model(model)
  staged.copy_weights_to(copied_back)
  served = tf.saved_model.load(inference.export_saved_model(
      model, str(tmp_path / "sm")))
  for got in (staged.predict(x, verbose=0),
              staged.to_unsplit().predict(x, verbose=0),
              copied_back.predict(x, verbose=0),
              inference.predict(model, [v.copy() for v in x],
                                strategy="mirrored"),
              served.serve(x).numpy()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _dropout_mlp():
  keras.utils.set_random_seed(0)
  x = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu", name="d1")(x)
  h = keras.layers.Dropout(0.5, seed=7, name="drop")(h)
  h = keras.layers.Dense(8, activation="relu", name="d2")(h)
  return keras.Model(x, keras.layers.Dense(1, name="out")(h))


def _fit_one_epoch(model, x, y):
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  model.fit(x, y, batch_size=16, shuffle=False, verbose=0)


@pytest.fixture(scope="module")
def dropout_run():
  """`(x, y, reference)`: the data, and `_dropout_mlp` after two epochs of
  Keras fit on one device (the same for every split path)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 8)).astype("float32")
  y = rng.normal(size=(32, 1)).astype("float32")
  reference = _dropout_mlp()
  _fit_one_epoch(reference, x, y)
  _fit_one_epoch(reference, x, y)
  return x, y, reference


@pytest.mark.parametrize("layout", ["staged", "tensor"])
@pytest.mark.parametrize("path", ["copy_back_and_split_again",
                                  "to_unsplit", "split_after_training"])
def test_seeded_dropout_continues_its_masks_across_splits(path, layout,
                                                          cpu_devices,
                                                          dropout_run):
  """A split copied back (`copy_weights_to`, `to_unsplit`) left the
  original's Dropout seed where it was, and a split started from the
  config's seed: the next epoch replayed the first one's masks (weights
  0.05 off Keras training the model throughout). The seed generators'
  states now travel with the weights."""
  x, y, reference = dropout_run
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top

  def split(m):
    if layout == "tensor":
      return hybrid.build_layout(m, hybrid.Layout(tensor=2),
                                 devices=cpu_devices[:2], rules={"d2": "column"})
    return StagedModel(m, partition.plan_stages(m, 2, split_points=["d2"]))

  model = _dropout_mlp()
  if path == "split_after_training":  # Keras, then a split.
    _fit_one_epoch(model, x, y)
    staged = split(model)
    _fit_one_epoch(staged, x, y)
    model = staged.to_unsplit()
  elif path == "to_unsplit":  # A split, then Keras on its unsplit form.
    staged = split(model)
    _fit_one_epoch(staged, x, y)
    model = staged.to_unsplit()
    _fit_one_epoch(model, x, y)
  else:  # A split, copied back, split again.
    staged = split(model)
    _fit_one_epoch(staged, x, y)
    staged.copy_weights_to(model)
    staged = split(model)
    _fit_one_epoch(staged, x, y)
    model = staged.to_unsplit()
  for got, want in zip(model.weights, reference.weights):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6,
                               err_msg=got.path)
