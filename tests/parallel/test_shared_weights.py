"""Shared (tied) weights stay one weight across stages, copies and clones."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import devices as devices_lib
from tfmgpu import inference
from tfmgpu.parallel import partition
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import shared
from tfmgpu.parallel import staged as staged_lib

VOCAB, WIDTH, LENGTH = 11, 8, 5
BATCH, STEPS, LR = 8, 3, 0.5


@keras.saving.register_keras_serializable("tfmgpu_tests")
class ReversibleEmbedding(keras.layers.Embedding):
  """keras_hub's trick: `reverse=True` maps vectors back onto the vocabulary
  with the transposed table (the tied LM head)."""

  def call(self, inputs, reverse=False):
    if reverse:
      return keras.ops.matmul(inputs, keras.ops.transpose(self.embeddings))
    return super().call(inputs)

  def compute_output_spec(self, inputs, reverse=False):
    if reverse:
      return keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.input_dim,),
                               dtype=self.compute_dtype)
    return super().compute_output_spec(inputs)


@keras.saving.register_keras_serializable("tfmgpu_tests")
class TiedHead(keras.layers.Layer):
  """Logits from an embedding layer it holds (the same layer object)."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def build(self, input_shape):
    if not self.embedding.built:
      self.embedding.build()
    self.bias = self.add_weight(shape=(self.embedding.input_dim,),
                                initializer="zeros", name="bias")

  def call(self, inputs):
    table = keras.ops.transpose(self.embedding.embeddings)
    return keras.ops.matmul(inputs, table) + self.bias

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.embedding.input_dim,)

  def get_config(self):
    return {**super().get_config(),
            "embedding": keras.saving.serialize_keras_object(self.embedding)}

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    config["embedding"] = keras.saving.deserialize_keras_object(
        config["embedding"])
    return cls(**config)


def _nested_lm(seed=0):
  """keras_hub's shape: a backbone model whose embedding the head reuses."""
  keras.utils.set_random_seed(seed)
  L = keras.layers
  embedding = ReversibleEmbedding(VOCAB, WIDTH, name="token_embedding")
  ids = keras.Input((LENGTH,), dtype="int32", name="token_ids")
  h = L.Dense(WIDTH, activation="tanh", name="block_0")(embedding(ids))
  h = L.Dense(WIDTH, activation="tanh", name="block_1")(h)
  backbone = keras.Model(ids, h, name="backbone")
  x = keras.Input((LENGTH,), dtype="int32", name="token_ids")
  h = L.Dense(WIDTH, name="head_norm")(backbone(x))
  return keras.Model(x, embedding(h, reverse=True), name="nested_lm")


def _flat_tied(seed=0):
  """An Embedding and a head layer holding that same Embedding object."""
  keras.utils.set_random_seed(seed)
  embedding = keras.layers.Embedding(VOCAB, WIDTH, name="token_embedding")
  ids = keras.Input((LENGTH,), dtype="int32", name="token_ids")
  h = keras.layers.Dense(WIDTH, activation="tanh", name="mix")(embedding(ids))
  return keras.Model(ids, TiedHead(embedding, name="tied_head")(h),
                     name="flat_tied")


MODELS = {"nested": (_nested_lm, "head_norm"), "flat": (_flat_tied, "tied_head")}


def _data(n=BATCH * STEPS):
  rng = np.random.RandomState(4)
  return (rng.randint(0, VOCAB, size=(n, LENGTH)).astype("int32"),
          rng.randint(0, VOCAB, size=(n, LENGTH)).astype("int64"))


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _split(model, split_point, kind):
  plan = partition.plan_stages(model, 2, split_points=[split_point])
  if kind == "model_parallel":
    return staged_lib.StagedModel(model, plan)
  return pipeline.PipelinedModel(model, plan, micro_batches=2,
                                 schedule="gpipe")


def _fit(model, x, y):
  model.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
  model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  return model


def _assert_layers_equal(placed, reference):
  """Every weighted layer of `placed` (unsplit form) equals `reference`'s."""
  by_name = {l.name: l for l in reference._flatten_layers()}  # pylint: disable=protected-access  (nested layers too)
  for name, layer in placed.weighted_layers().items():
    want = by_name[name].get_weights()
    got = layer.get_weights()
    assert len(got) == len(want), name
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("kind", ["model_parallel", "pipeline"])
@pytest.mark.parametrize("which", sorted(MODELS))
def test_tied_weight_trains_as_one_weight(which, kind):
  build, split_point = MODELS[which]
  x, y = _data()
  placed = _split(build(), split_point, kind)
  assert len(placed.trainable_variables) == len(build().trainable_variables)
  reference = _fit(build(), x, y)
  _fit(placed, x, y)
  moved = np.abs(reference.get_layer("token_embedding").get_weights()[0] -
                 build().get_layer("token_embedding").get_weights()[0]).max()
  assert moved > 1e-3  # The test would see an untrained copy.
  _assert_layers_equal(placed, reference)


@pytest.mark.parametrize("which", sorted(MODELS))
def test_the_plan_names_the_weight_and_its_stages(which):
  build, split_point = MODELS[which]
  model = build()
  plan = partition.plan_stages(model, 2, split_points=[split_point])
  (weight,) = plan.shared
  assert weight.path == "token_embedding/embeddings"
  assert weight.stages == (0, 1)
  assert "token_embedding/embeddings" in plan.table()
  assert "stages 0, 1" in plan.table()
  placed = staged_lib.StagedModel(model, plan)
  assert placed.plan.shared == plan.shared
  first, second = placed.stages
  owner = first.get_layer("token_embedding")  # The backbone is cut too.
  # The second call of a layer is the plan's `<name>.2`.
  reader = second.get_layer(weight.layers[1].removesuffix(".2"))
  assert any(w is owner.embeddings for w in reader.weights)
  assert (devices_lib.canonical_device(owner.embeddings.value.device) ==
          devices_lib.canonical_device(placed.stage_devices[0]))


@pytest.mark.parametrize("which", sorted(MODELS))
def test_copy_weights_to_and_to_unsplit_keep_one_weight(which):
  build, split_point = MODELS[which]
  x, y = _data()
  placed = _fit(_split(build(), split_point, "model_parallel"), x, y)
  want = placed.predict(x, verbose=0)
  fresh = build(seed=7)
  placed.copy_weights_to(fresh)
  np.testing.assert_allclose(fresh.predict(x, verbose=0), want, rtol=1e-5,
                             atol=1e-6)
  unsplit = placed.to_unsplit()
  assert len(unsplit.weights) == len(build().weights)
  np.testing.assert_allclose(unsplit.predict(x, verbose=0), want, rtol=1e-5,
                             atol=1e-6)
  # Trained again, the rebuilt model still holds one embedding.
  before = _fit(build(), x, y)
  placed.copy_weights_to(before)
  np.testing.assert_allclose(
      _fit(unsplit, x, y).predict(x, verbose=0),
      _fit(before, x, y).predict(x, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", sorted(MODELS))
def test_mirrored_serving_and_export_keep_the_tie(which, tmp_path):
  model = MODELS[which][0]()
  x, _ = _data()
  want = model.predict(x, verbose=0)
  got = inference.predict(model, x, strategy="mirrored", batch_size=BATCH)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  path = inference.export_saved_model(model, str(tmp_path / "saved"))
  loaded = tf.saved_model.load(path)
  np.testing.assert_allclose(loaded.serve(tf.constant(x)).numpy(), want,
                             rtol=1e-5, atol=1e-6)


def test_a_layer_that_cannot_keep_the_tie_is_refused():
  layers = {"a": keras.layers.Dense(2), "b": keras.layers.Dense(3)}
  for layer in layers.values():
    layer.build((None, 4))
  weight = shared.SharedWeight("emb/embeddings", (("a", 0), ("b", 0)))
  with pytest.raises(ValueError, match=r"emb/embeddings.*\(4, 2\).*\(4, 3\)"):
    shared.tie(layers, [weight], "stage model")


GPT2 = dict(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=16, dropout=0.0)


def _gpt2(seed=0):
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(seed)
  backbone = keras_hub.models.GPT2Backbone(**GPT2)
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def test_keras_hub_gpt2_split_equals_one_device_fit():
  """Staged (model parallel); GPT-2 pipelined (GPipe, 2 micro-batches) with
  the table across its stages is `test_hub_models`' tied-embedding test."""
  model = _gpt2()
  rng = np.random.RandomState(5)
  n, length = BATCH * STEPS, 8
  x = {"token_ids": rng.randint(1, 64, size=(n, length)).astype("int32"),
       "padding_mask": np.ones((n, length), dtype=bool)}
  x["padding_mask"][:, 6:] = False
  y = rng.randint(1, 64, size=(n, length)).astype("int32")
  weights = x["padding_mask"].astype("float32")
  # Cut between the backbone's blocks: the tied embedding and LM head apart.
  plan = partition.plan_stages(model, 2,
                               split_points=["transformer_layer_1"])
  assert [w.path for w in plan.shared] == ["token_embedding/embeddings"]
  assert plan.shared[0].layers == ("token_embedding", "token_embedding.2")
  pipe = staged_lib.StagedModel(model, plan)
  for m in (pipe, model):
    m.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    m.fit(x, y, sample_weight=weights, batch_size=BATCH, shuffle=False,
          verbose=0)
  _assert_layers_equal(pipe, model)
  np.testing.assert_allclose(pipe.predict(x, batch_size=BATCH, verbose=0),
                             model.predict(x, batch_size=BATCH, verbose=0),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [
    dict(data=2, stages=2, micro_batches=2, schedule="1f1b"),
    dict(stages=2, tensor=2)], ids=["data2_1f1b", "stages2_tensor2"])
def test_layouts_train_the_tied_weight_as_one(layout, cpu_devices):
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  x, y = _data()
  model = _nested_lm()
  plan = partition.plan_stages(model, 2, split_points=["head_norm"])
  placed = hybrid.build_layout(model, hybrid.Layout(**layout),
                               devices=cpu_devices, plan=plan,
                               rules={"head_norm": "column"})
  reference = _fit(_nested_lm(), x, y)
  _fit(placed, x, y)
  _assert_layers_equal(placed, reference)


@keras.saving.register_keras_serializable("tfmgpu_tests")
class TransposedKernel(keras.layers.Layer):
  """Multiplies by the transposed kernel of a Dense layer it holds."""

  def __init__(self, dense, **kwargs):
    super().__init__(**kwargs)
    self.dense = dense

  def call(self, inputs):
    return keras.ops.matmul(inputs, keras.ops.transpose(self.dense.kernel))

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.dense.kernel.shape[0],)


def test_splitting_a_shared_weight_over_devices_is_refused(cpu_devices):
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  x = keras.Input((4,))
  proj = keras.layers.Dense(8, name="proj")
  model = keras.Model(x, TransposedKernel(proj, name="back")(proj(x)))
  with pytest.raises(ValueError, match=r"'proj/kernel' is shared by layers "
                     r"\['proj', 'back'\] and a tensor-parallel rule splits "
                     r"\['proj'\]"):
    tensor.tensor_parallel(model, cpu_devices[:2], rules={"proj": "column"})


def test_branches_sharing_a_weight_are_refused(cpu_devices):
  from tfmgpu.parallel import branches  # pylint: disable=g-import-not-at-top
  dense = keras.layers.Dense(3, name="shared_dense")
  make = lambda name: keras.Sequential([keras.Input((4,)), dense], name=name)
  with pytest.raises(ValueError, match=r"shared_dense/kernel' is shared by "
                     r"branches \[0, 1\]"):
    branches.BranchParallel([make("a"), make("b")], devices=cpu_devices[:2])


def test_a_regularized_weight_shared_between_stages_is_refused():
  keras.utils.set_random_seed(0)
  embedding = keras.layers.Embedding(
      VOCAB, WIDTH, embeddings_regularizer="l2", name="token_embedding")
  ids = keras.Input((LENGTH,), dtype="int32")
  h = keras.layers.Dense(WIDTH, name="mix")(embedding(ids))
  model = keras.Model(ids, TiedHead(embedding, name="tied_head")(h))
  plan = partition.plan_stages(model, 2, split_points=["tied_head"])
  with pytest.raises(ValueError, match=r"'token_embedding/embeddings' is used "
                     r"on stages \[0, 1\].*regularizer"):
    staged_lib.StagedModel(model, plan)


def test_the_core_never_imports_keras_hub():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys, tfmgpu, tfmgpu.inference, tfmgpu.parallel.staged, "
          "tfmgpu.parallel.pipeline, tfmgpu.parallel.tensor, "
          "tfmgpu.parallel.branches, tfmgpu.parallel.shared; "
          "print('keras_hub' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("which", sorted(MODELS))
def test_portable_checkpoints_move_the_tied_weight_between_layouts(
    which, tmp_path):
  from tfmgpu.training import portable  # pylint: disable=g-import-not-at-top
  build, split_point = MODELS[which]
  x, y = _data()
  placed = _fit(_split(build(), split_point, "pipeline"), x, y)
  view = portable.PortableView(placed)
  path = tf.train.Checkpoint(**{portable.VIEW: view}).write(
      str(tmp_path / "ckpt"))
  want = placed.predict(x, verbose=0)
  unsplit = portable.restore_weights(build(seed=3), path)
  np.testing.assert_allclose(unsplit.predict(x, verbose=0), want, rtol=1e-5,
                             atol=1e-6)
  other = portable.restore_weights(
      _split(build(seed=3), split_point, "model_parallel"), path)
  assert len(other.trainable_variables) == len(build().trainable_variables)
  np.testing.assert_allclose(other.predict(x, verbose=0), want, rtol=1e-5,
                             atol=1e-6)


def test_keras_hub_gpt2_unsplit_and_serving_copies_keep_one_embedding():
  """`export_saved_model(placed)` is `to_unsplit` (checked here) and then
  the plain export: a keras_hub GPT-2's, loaded and compared, is
  `test_generation_export`'s; a staged model's, `test_staged`'s."""
  model = _gpt2()
  rng = np.random.RandomState(6)
  x = {"token_ids": rng.randint(1, 64, size=(BATCH, 8)).astype("int32"),
       "padding_mask": np.ones((BATCH, 8), dtype=bool)}
  want = model.predict(x, batch_size=BATCH, verbose=0)
  placed = staged_lib.StagedModel.from_model(
      model, split_points=["transformer_layer_1"], num_stages=2)
  unsplit = placed.to_unsplit()
  assert len(unsplit.weights) == len(model.weights)
  np.testing.assert_allclose(unsplit.predict(x, verbose=0), want, rtol=1e-5,
                             atol=1e-5)
  got = inference.predict(model, x, strategy="mirrored", batch_size=BATCH)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_run_summary_names_the_shared_weight(cpu_devices):
  from tfmgpu.strategies import registry  # pylint: disable=g-import-not-at-top
  dist = registry.lookup("pipeline")
  options = dist.Options(num_stages=2)
  placement = dist.place(options, _nested_lm)
  rows = dict(dist.describe(placement))
  assert "token_embedding/embeddings (stages 0, 1)" in rows["shared weights"]
  assert placement.plan.shared[0].layers == ("token_embedding",
                                            "token_embedding.2")


@pytest.mark.parametrize("kind", ["model_parallel", "pipeline"])
def test_each_use_differentiates_on_its_stage_and_sums_on_the_owner(kind):
  from tfmgpu.parallel import inspection  # pylint: disable=g-import-not-at-top
  placed = _split(_nested_lm(), "head_norm", kind)
  x, y = _data(BATCH)
  loss = _loss()
  step = tf.function(
      lambda xb, yb: placed.compute_loss_and_gradients(xb, yb, loss)[2])
  ops = inspection.op_placements(step.get_concrete_function(x, y))
  sums = {p.device for p in ops if "shared_weight_sum" in p.name}
  owner, reader = (devices_lib.canonical_device(d)
                   for d in placed.stage_devices)
  assert sums == {owner}
  # The head's use of the table is differentiated on its own stage.
  head = {p.device for p in ops if p.name.startswith("gradient_tape/") and
          "token_embedding" in p.name and p.type == "Transpose"}
  assert head == {reader}


def test_the_memory_estimate_keeps_slots_of_a_shared_weight_on_its_owner():
  model = _nested_lm()
  plan = partition.plan_stages(model, 2, split_points=["head_norm"])
  (weight,) = plan.shared
  assert weight.bytes == VOCAB * WIDTH * 4
  sgd = plan.memory_estimate(BATCH, optimizer="sgd")
  adam = plan.memory_estimate(BATCH, optimizer="adam")
  first, second = plan.stages
  extra = [adam[s.device].optimizer_slots - sgd[s.device].optimizer_slots
           for s in plan.stages]
  assert extra == [2 * first.trainable_param_bytes,
                   2 * (second.trainable_param_bytes - weight.bytes)]
  params = model.count_params() * 4
  assert f"{params / 1024:.1f} KiB" in plan.table().splitlines()[-3]


def test_layout_accounts_count_a_shared_weight_on_shard_0_only():
  from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
  model = _nested_lm()
  plan = partition.plan_stages(model, 2, split_points=["head_norm"],
                               devices=["/gpu:0", "/gpu:1"],
                               check_devices=False)
  split = accounting.tensor_split(model, {"head_norm": "column"})
  account = accounting.account_layout(plan, split, global_batch_size=BATCH,
                                      tensor=2, optimizer="adam")
  slots = {(d.stage, d.shard): d.memory.optimizer_slots
           for d in account.devices}
  head_norm = 2 * (WIDTH * WIDTH + WIDTH) * 4  # Adam: two slots.
  assert slots[(1, 1)] == head_norm // 2
  assert slots[(1, 0)] == head_norm // 2  # token_embedding's: on stage 0.
