"""Tensor parallelism: `gpt` tiny (with a padding mask) split over T devices
trains to the unsplit weights, each shard's forward and backward ops on its
device; the split layers show the unsplit weights; errors name the layer.
"""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import devices as devices_lib
from tfmgpu.models import gpt
from tfmgpu.parallel import inspection
from tfmgpu.parallel import partition
from tfmgpu.parallel import staged as staged_lib
from tfmgpu.parallel import tensor

import test_gpt_parallel as gpt_tests  # pylint: disable=g-bad-import-order  (data, loop)

HEADS = 4  # tiny has 2 heads; 4 so that T=4 splits them.
MATMULS = ("MatMul", "BatchMatMulV2", "Einsum")
RESOURCE_OPS = {"Placeholder", "ReadVariableOp", "VarHandleOp"}
# A shard's ops sit in the name scope `<layer>_shard<t>` (forward), and its
# backward in `<layer>_shard<t>_backward` or under the inner tape's
# `gradient_tape/.../<layer>_shard<t>/...`.
_SHARD = re.compile(r"^(\w+?)_shard(\d+)(_backward)?(?:_\d+)?$")


def _gpt(seed=0, **overrides):
  keras.utils.set_random_seed(seed)
  overrides.setdefault("num_heads", HEADS)
  return gpt.gpt(gpt_tests.SHAPE, gpt_tests.VOCAB, size="tiny", **overrides)


@pytest.fixture(scope="module")
def data():
  return gpt_tests._data()  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def reference(data):
  """`({optimizer: (losses, weights)}, initial weights)`, unsplit."""
  out = {}
  for name, (make, _) in gpt_tests.OPTIMIZERS.items():
    model = _gpt()
    out[name] = (gpt_tests._train(model, *data, make())[0],  # pylint: disable=protected-access
                 model.get_weights())
  return out, _gpt().get_weights()


@pytest.fixture(scope="module")
def runs(data):
  """`run(T, optimizer) -> (TensorParallelModel, losses, traced step)`,
  each trained once per module."""
  cache = {}

  def run(T, name):
    if (T, name) not in cache:
      devices = tf.config.list_logical_devices("CPU")[:T]
      tp = tensor.TensorParallelModel(_gpt(), [d.name for d in devices])
      losses, step = gpt_tests._train(  # pylint: disable=protected-access
          None, *data, gpt_tests.OPTIMIZERS[name][0](), split=tp)
      cache[(T, name)] = tp, losses, step
    return cache[(T, name)]

  return run


def _unsplit_weights(split):
  model = _gpt(seed=1)  # Other initial weights: all are overwritten.
  split.copy_weights_to(model)
  return model.get_weights()


# ------------------------------------------------------------------ parity


# T=4 with SGD: T=4's split is (4, "adam")'s, SGD's update (2, "sgd")'s.
RUNS = [(2, "sgd"), (4, "adam")]


@pytest.mark.parametrize("T,name", RUNS)
def test_tensor_parallel_gpt_trains_as_unsplit(data, reference, runs, T,
                                               name):
  tp, losses, _ = runs(T, name)
  assert tp.tensor_parallel == T and len(set(tp.devices)) == T
  kinds = collections.Counter(type(l).__name__ for l in tp.model.layers)
  assert (kinds["HeadParallelAttention"], kinds["ColumnParallelDense"],
          kinds["RowParallelDense"]) == (2, 2, 2)
  gpt_tests._assert_equal_training(  # pylint: disable=protected-access
      losses, _unsplit_weights(tp), reference, name)
  unsplit = tp.to_unsplit()
  np.testing.assert_allclose(unsplit.get_weights()[5],
                             _unsplit_weights(tp)[5])
  x = {k: v[:gpt_tests.BATCH] for k, v in data[0].items()}
  np.testing.assert_allclose(tp.predict(x, verbose=0),
                             unsplit.predict(x, verbose=0), rtol=1e-5,
                             atol=1e-5)


def test_untrained_split_equals_unsplit_eagerly(data, cpu_devices):
  """Eager forward and gradients (no tf.function) through the shards."""
  model = _gpt()
  tp = tensor.TensorParallelModel(model, cpu_devices[:2])
  x = {k: v[:gpt_tests.BATCH] for k, v in data[0].items()}
  y = data[1][:gpt_tests.BATCH]
  np.testing.assert_allclose(tp(x), model(x), rtol=1e-5, atol=1e-5)
  loss, _, grads = tp.compute_loss_and_gradients(x, y, gpt_tests._loss())  # pylint: disable=protected-access
  with tf.GradientTape() as tape:
    want = gpt_tests._loss()(y, model(x, training=True))  # pylint: disable=protected-access
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  # One SGD step by hand, compared in the unsplit form.
  for v, g in zip(tp.trainable_variables, grads):
    v.assign_sub(0.1 * tf.convert_to_tensor(g))
  for v, g in zip(model.trainable_variables,
                  tape.gradient(want, model.trainable_variables)):
    v.assign_sub(0.1 * tf.convert_to_tensor(g))
  for i, (u, w) in enumerate(zip(_unsplit_weights(tp), model.get_weights())):
    np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-6, err_msg=str(i))


# --------------------------------------------------------------- placement


def _shard_ops(placements):
  """`{(layer, shard, "forward" | "backward"): [OpPlacement]}`."""
  out = collections.defaultdict(list)
  for p in placements:
    parts = p.name.split("/")
    for i, part in enumerate(parts):
      m = _SHARD.match(part)
      if m:
        backward = bool(m.group(3)) or "gradient_tape" in parts[:i]
        kind = "backward" if backward else "forward"
        out[(m.group(1), int(m.group(2)), kind)].append(p)
        break
  return out


def _assert_shard_variables_on_their_devices(layer):
  """Each shard's variables on its device; a weight held once on devices[0]."""
  for variables, axis in layer._unsplit_layout():  # pylint: disable=protected-access
    want = layer.devices if axis is not None else layer.devices[:1]
    got = [devices_lib.canonical_device(v.value.device) for v in variables]
    assert got == list(want), layer.name


def _misplaced(ops, device):
  return [(p.name, p.device) for p in ops if p.device != device and not (
      p.device == "" and (p.type in RESOURCE_OPS or p.colocated))]


@pytest.mark.parametrize("T,name", RUNS)
def test_each_shard_runs_forward_and_backward_on_its_device(runs, T, name):
  tp, _, step = runs(T, name)
  by_shard = _shard_ops(inspection.op_placements(step))
  split = [l for l in tp.model.layers if isinstance(l, tensor.ShardedLayer)]
  assert {l.name for l in split} >= {"block0_attention", "block1_mlp_up",
                                     "block1_mlp_down"}
  for layer in split:
    assert layer.devices == tp.devices
    for t, device in enumerate(layer.devices):
      for kind in ("forward", "backward"):
        ops = by_shard[(layer.name, t, kind)]
        assert any(p.type in MATMULS for p in ops), (layer.name, t, kind)
        assert _misplaced(ops, device) == [], (layer.name, t, kind)
  for layer in split:
    _assert_shard_variables_on_their_devices(layer)
  assert len(by_shard) == 2 * T * len(split)  # Nothing else in those scopes.


def test_on_device_backward_stays_on_its_device_under_an_outer_tape(
    cpu_devices):
  """One outer tape on device 0: without `on_device` the backward of a
  computation placed on device 1 lands on device 0 (GradientTape does not
  colocate gradients with their forward ops); with it, on device 1. An int
  input gets no gradient; eager and traced gradients equal the plain ones."""
  home, far = cpu_devices[0], cpu_devices[1]
  rng = np.random.RandomState(0)
  with tf.device(far):
    w = tf.Variable(rng.randn(3, 4).astype("float32"))
  x = tf.constant(rng.randn(2, 3).astype("float32"))
  ids = tf.constant([3, 1], tf.int32)
  f = lambda a, i: tf.gather(tf.tanh(tf.matmul(a, w)), i, axis=1)

  def grads(use):
    with tf.device(home), tf.GradientTape() as tape:
      tape.watch(x)
      if use:
        y = tensor.on_device(far, f, x, ids, name="probe_shard0")
      else:
        with tf.device(far), tf.name_scope("probe_shard0"):
          y = f(x, ids)
      loss = tf.reduce_sum(y * y)
    with tf.device(home):
      return tape.gradient(loss, [x, w])

  for a, b in zip(grads(True), grads(False)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  for use, device in ((True, far), (False, home)):
    ops = _shard_ops(inspection.op_placements(
        tf.function(lambda u=use: grads(u)).get_concrete_function()))
    backward = [p for p in ops[("probe", 0, "backward")] if p.type in MATMULS]
    assert backward and {p.device for p in backward} == {device}, use
  traced = tf.function(lambda: grads(True))()
  for a, b in zip(traced, grads(False)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# ----------------------------------------------------------------- weights


def test_split_layers_show_and_take_the_unsplit_weights(cpu_devices):
  model = _gpt()
  split = tensor.tensor_parallel(model, cpu_devices[:2])
  names = ("block0_attention", "block0_mlp_up", "block0_mlp_down")
  for name in names:
    want = model.get_layer(name).get_weights()
    got = split.get_layer(name).get_weights()
    assert [w.shape for w in got] == [w.shape for w in want], name
    for u, v in zip(got, want):
      np.testing.assert_array_equal(u, v)
  up = split.get_layer("block0_mlp_up")
  new = [w + 1.0 for w in up.get_weights()]
  up.set_weights(new)
  np.testing.assert_array_equal(up.get_weights()[0], new[0])
  np.testing.assert_array_equal(up.kernels[1].numpy(),
                                new[0][:, new[0].shape[1] // 2:])
  down = split.get_layer("block0_mlp_down")
  np.testing.assert_array_equal(down.kernels[1].numpy(),
                                down.get_weights()[0][64:])
  with pytest.raises(ValueError, match=r"'block0_mlp_up' .*expects 2 "
                     r"weights of shapes \[\(32, 128\), \(128,\)\]"):
    up.set_weights(new[:1])


def test_config_round_trip_keeps_devices(cpu_devices):
  split = tensor.tensor_parallel(_gpt(), cpu_devices[2:4])
  h = keras.Input((gpt_tests.T, 32))
  for name in ("block0_attention", "block0_mlp_up", "block0_mlp_down"):
    layer = split.get_layer(name)
    with tf.device(cpu_devices[0]):  # A stage's scope does not move shards.
      clone = keras.saving.deserialize_keras_object(
          keras.saving.serialize_keras_object(layer))
    assert type(clone) is type(layer)
    assert clone.devices == tuple(cpu_devices[2:4]) == layer.devices
    assert clone.get_config() == layer.get_config()
    if name == "block0_attention":
      clone(h, h, use_causal_mask=True)
    elif name == "block0_mlp_up":
      clone(h)
    else:
      clone([keras.Input((gpt_tests.T, 64))] * 2)
    clone.set_weights(layer.get_weights())
    _assert_shard_variables_on_their_devices(clone)
    for u, v in zip(clone.get_weights(), layer.get_weights()):
      np.testing.assert_array_equal(u, v)


# ------------------------------------------------------------------ errors


def test_split_attention_reads_the_inputs_keras_masks(cpu_devices):
  """`Embedding(mask_zero=True)`'s mask reached MultiHeadAttention but not
  its head-split copy: 0.049 off on real tokens, and the pooling after it
  lost the mask too."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top

  def build():
    keras.utils.set_random_seed(0)
    ids = keras.Input((10,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True, name="emb")(ids)
    h = keras.layers.MultiHeadAttention(2, 4, name="attn")(h, h)
    return keras.Model(ids, keras.layers.Dense(3, name="head")(
        keras.layers.GlobalAveragePooling1D()(h)))

  rng = np.random.default_rng(0)
  rows = rng.integers(1, 20, (8, 10)).astype("int32")
  for i, length in enumerate(rng.integers(2, 10, 8)):
    rows[i, length:] = 0
  split = hybrid.build_layout(build(), hybrid.Layout(tensor=2),
                              rules={"attn": "heads"})
  np.testing.assert_allclose(split.predict(rows, verbose=0),
                             build().predict(rows, verbose=0), atol=1e-6)


def test_split_attention_clears_its_inputs_masks_as_keras_does(cpu_devices):
  """Keras' MultiHeadAttention clears the Keras masks of its inputs, so the
  residual `Add([h, attention(h)])` carries none and a second attention
  applies only its `attention_mask`; the head-split copy kept them, and
  the second one masked the padding too (0.066 off)."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top

  def build():
    keras.utils.set_random_seed(1)
    ids = keras.Input((6,), dtype="int32", name="ids")
    allowed = keras.Input((6, 6), dtype="bool", name="allowed")
    h = keras.layers.Embedding(20, 8, mask_zero=True, name="emb")(ids)
    h = keras.layers.Add()([h, keras.layers.MultiHeadAttention(
        2, 4, name="a1")(h, h, use_causal_mask=True)])
    h = keras.layers.Add()([h, keras.layers.MultiHeadAttention(
        2, 4, name="a2")(h, h, attention_mask=allowed)])
    return keras.Model({"ids": ids, "allowed": allowed}, h)

  rng = np.random.default_rng(0)
  ids = rng.integers(1, 20, (8, 6)).astype("int32")
  for i, length in enumerate(rng.integers(2, 7, 8)):
    ids[i, length:] = 0
  allowed = rng.uniform(size=(8, 6, 6)) > 0.3
  allowed[:, np.arange(6), np.arange(6)] = True
  x = {"ids": ids, "allowed": allowed}
  split = hybrid.build_layout(build(), hybrid.Layout(tensor=2),
                              rules={"a1|a2": "heads"})
  np.testing.assert_allclose(split.predict(x, verbose=0),
                             build().predict(x, verbose=0), atol=1e-6)


def test_heads_not_divisible_names_the_layer(cpu_devices):
  with pytest.raises(ValueError, match=(
      r"layer 'block0_attention' \(MultiHeadAttention, num_heads=2, "
      r"key_dim=16\) matches a 'heads' tensor-parallel rule but cannot be "
      r"split over T=4 devices: num_heads=2 is not divisible by T=4\. "
      r"Change the rules so they skip it, or use a T that divides its "
      r"sizes\.")):
    tensor.tensor_parallel(_gpt(num_heads=2), cpu_devices[:4])


@pytest.mark.parametrize("argument", [
    dict(sliding_window=2), dict(use_gate=True), dict(output_shape=(6,)),
    dict(kernel_regularizer="l2"), dict(kernel_constraint="max_norm")])
def test_an_attention_argument_no_split_keeps_is_refused_without_another_t(
    argument, cpu_devices):
  """The refusal ended "or use a T that divides its sizes", which no T
  helps with when the argument is what cannot split."""
  inputs = keras.Input((8, 8))
  h = keras.layers.MultiHeadAttention(2, 4, name="att", **argument)(
      inputs, inputs)
  with pytest.raises(ValueError, match=(
      rf"split layers do not support {next(iter(argument))}\. Change the "
      r"rules so they skip it\.$")):
    tensor.tensor_parallel(keras.Model(inputs, h), cpu_devices[:2],
                           rules={"att": "heads"})


def test_rule_on_a_layer_norm_names_the_layer(cpu_devices):
  with pytest.raises(ValueError, match=(
      r"layer 'block0_ln1' \(LayerNormalization, .*\) matches a 'column' "
      r"tensor-parallel rule .* a 'column' rule splits a Dense, not a "
      r"LayerNormalization")):
    tensor.tensor_parallel(_gpt(), cpu_devices[:2],
                           rules={r"block\d_ln1": "column"})


def test_rules_matching_nothing_raise(cpu_devices):
  """What to do comes first; a model's many layers are shortened (a
  MobileNetV2's 155 names came before the advice, 3,703 characters)."""
  with pytest.raises(ValueError, match=r"match no layer of model 'gpt'; "
                     r"nothing would be split.*on the command line "
                     r"`--tensor_rules=\w+=column`, in Python `rules=") as e:
    tensor.tensor_parallel(_gpt(), cpu_devices[:2],
                           rules={"mlp_up": "column"})  # Not a full match.
  assert re.search(r"Its layers: \w+, .*, \.\.\., .*; \d+ in all\.$",
                   str(e.value))
  assert len(str(e.value)) < 700, str(e.value)


def test_parse_rules():
  assert tensor.parse_rules(" .*_up=column, .*_down=row ") == {
      ".*_up": "column", ".*_down": "row"}
  assert list(tensor.parse_rules("a=row,b=heads")) == ["a", "b"]
  with pytest.raises(ValueError, match=r"rule '\.\*_up'='diagonal': unknown "
                     r"kind 'diagonal'; choose one of column, row, heads"):
    tensor.parse_rules(".*_up=diagonal")
  with pytest.raises(ValueError, match=r"rule 'block0_mlp_up' must be "
                     "regex=kind"):
    tensor.parse_rules("x=row,block0_mlp_up")
  with pytest.raises(ValueError, match=r"rule '\('='row': the regex does not "
                     "compile"):
    tensor.parse_rules("(=row")


def test_bad_devices_and_dropout(cpu_devices):
  with pytest.raises(ValueError, match="devices=.* or devices_for=.*exactly "
                     "one"):
    tensor.tensor_parallel(_gpt(), cpu_devices[:2],
                           devices_for=lambda name: cpu_devices[:2])
  with pytest.raises(ValueError, match="'/gpu:7' does not exist"):
    tensor.TensorParallelModel(_gpt(), [cpu_devices[0], "/gpu:7"])
  with pytest.raises(ValueError, match=r"dropout=0\.1; split attention does "
                     "not support dropout"):
    tensor.HeadParallelAttention(2, 8, cpu_devices[:2], dropout=0.1)


# ------------------------------------------------------- inside a pipeline


def test_tensor_parallel_stages_train_as_unsplit(data, reference,
                                                 cpu_devices):
  """2 stages x T=2: a plan made from the unsplit model, each stage's split
  layers on that stage's 2 devices (`devices_for`), the split model cut
  along the plan by `StagedModel`."""
  model = _gpt()
  homes = [cpu_devices[0], cpu_devices[2]]
  plan = partition.plan_stages(model, 2, devices=homes)
  stage_of = {l: k for k, s in enumerate(plan.stages) for l in s.layers}
  shards = [cpu_devices[0:2], cpu_devices[2:4]]
  split = tensor.tensor_parallel(
      model, devices_for=lambda name: shards[stage_of[name]])
  staged = staged_lib.StagedModel(split, plan)
  losses, _ = gpt_tests._train(None, *data, gpt_tests.OPTIMIZERS["sgd"][0](),  # pylint: disable=protected-access
                               split=staged)
  gpt_tests._assert_equal_training(  # pylint: disable=protected-access
      losses, _unsplit_weights(staged), reference, "sgd")
  for stage, devices in zip(staged.stages, shards):
    split_layers = [l for l in stage.layers
                    if isinstance(l, tensor.ShardedLayer)]
    assert split_layers and all(l.devices == tuple(devices)
                                for l in split_layers)


def test_a_layout_map_axis_the_weight_lacks_is_refused():
  """Found by a new user: `{".*query/kernel": 5}` on a 3-D kernel was
  accepted and ignored. Now an axis outside the weight's rank is named;
  `None` keeps what it matches whole; a negative axis counts from the
  last."""
  from tfmgpu.parallel import layout_maps  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((4,)),
                            keras.layers.Dense(6, name="up"),
                            keras.layers.Dense(2, name="down")],
                           name="mapped")
  with pytest.raises(ValueError, match=r"layout_map entry 'up/kernel': 5 "
                     r"matches weight 'mapped/up/kernel' of shape \(4, 6\), which "
                     r"has no axis 5. Give an axis from 0 to 1"):
    layout_maps.path_rules(model, {"up/kernel": 5})
  assert layout_maps.path_rules(
      model, {"up/kernel": -1, "down/kernel": None, "kernel": 0}) == {
          "mapped/up/kernel": 1}
