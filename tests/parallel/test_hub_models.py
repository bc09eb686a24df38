"""keras_hub models train under tfmgpu's layouts equal to one-device Keras.

The lean CI subset of `scripts/hub_matrix.py` (the full matrix of 5 models
x 7 layouts is the script's): each model and each layout of up to 4 devices
at least once (Llama in the frozen, LoRA and compiled-model tests, Gemma in
the tied-embedding one), the one-device reference fit once per model and
optimizer; the 2 x 2 x 2 case is in `test_3d.py` (8 devices). Where a
tensor split's ops run is `test_fused_blocks`'.
"""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest

from tfmgpu.parallel import accounting
from tfmgpu.parallel import cloning
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import hybrid
from tfmgpu.parallel import layout_maps

keras_hub = pytest.importorskip("keras_hub")

_SPEC = importlib.util.spec_from_file_location(
    "hub_matrix", pathlib.Path(__file__).parents[2] / "scripts" /
    "hub_matrix.py")
matrix = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(matrix)


@pytest.fixture(scope="module")
def references():
  """`get(family, optimizer)`: one-device `fit`'s weights, trained once."""
  cache = {}

  def get(family, optimizer="sgd"):
    if (family, optimizer) not in cache:
      cache[(family, optimizer)] = matrix.reference_weights(family, optimizer)
    return cache[(family, optimizer)]
  return get


# Llama under 1f1b2 and tensor2 trains in the compiled-model test below (and
# tensor2 frozen); the BERT classifier's 2 stages are model_parallel2's;
# Gemma's stages (and GPipe, GPT-2's) in the tied-embedding test, with Adam.
@pytest.mark.parametrize("family,layout", [
    ("bert", "mirrored2"),
    ("bert", "model_parallel2"),
    ("bert", "tensor2"),
    ("qwen", "data2_tensor2"),
])
def test_keras_hub_model_trains_as_one_device_keras(family, layout,
                                                    cpu_devices, references):
  predicted, diff = matrix.run_case(family, layout, cpu_devices,
                                    reference=references(family))
  assert predicted <= 1e-5
  assert diff <= 1e-5


@pytest.mark.parametrize("family,layout", [("gpt2", "gpipe2"),
                                           ("gemma", "1f1b2")])
def test_a_tied_embedding_across_stages_trains_as_one_device_adam(
    family, layout, cpu_devices):
  """The token table is used by the first stage (a sparse lookup) and the
  last (the dense LM head): Adam squares the summed gradient, so the parts
  must be added as one dense gradient, as TF's tape adds them (concatenated
  as rows they ended 3e-2 away)."""
  predicted, diff = matrix.run_case(family, layout, cpu_devices, "adam")
  assert predicted <= 1e-5
  assert diff <= 1e-5


@pytest.mark.parametrize("family,layout", [("llama+frozen", "tensor2"),
                                           ("gpt2+frozen", "1f1b2"),
                                           ("llama+lora", "gpipe2")])
def test_frozen_blocks_and_lora_stay_as_the_user_left_them(family, layout,
                                                           cpu_devices):
  """A block rebuilt from its backbone's config came back trainable and
  without LoRA: a frozen block trained (drift 3.9e-2, no warning) and a
  LoRA model failed to copy its weights."""
  predicted, diff = matrix.run_case(family, layout, cpu_devices)
  assert predicted <= 1e-5
  assert diff <= 1e-5
  model = matrix.build(family)
  placed = hybrid.build_layout(model, hybrid.Layout(stages=2),
                               devices=cpu_devices[:2])
  frozen = {v.path for v in model.weights if not v.trainable}
  copies = [placed.to_unsplit(), cloning.copy_model(model, same_class=True)]
  for copy in copies:  # What serving and `generate` copy.
    assert frozen and frozen == {v.path for v in copy.weights
                                 if not v.trainable}


def test_a_model_with_lora_is_not_split_by_tensors(cpu_devices):
  """A LoRA model splits into stages (above), not by tensors: refused,
  naming the rank and what to use instead."""
  lora = matrix.build("llama+lora")
  with pytest.raises(ValueError, match=r"cannot split it: it has LoRA "
                     r"enabled \(rank 2\).*stages"):
    hybrid.build_layout(lora, hybrid.Layout(tensor=2), devices=cpu_devices[:2])
  # The planner weighs no tensor layout of it (its costing crashed).
  assert "LoRA enabled" in accounting._split_of(  # pylint: disable=protected-access
      lora, None, 2).why_not(2)


@pytest.mark.parametrize("layout", ["staged", "data2_stages2", "tensor2"])
def test_enable_lora_after_the_split_is_refused(layout, cpu_devices):
  """`enable_lora()` on the model after it was split: the split trained
  every base weight in full (21 of 21 moved) and no LoRA weight (it had
  none), silently; the weights added are named."""
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel.staged import StagedModel  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  model = matrix.build("llama")
  if layout == "staged":
    placed = StagedModel(model, partition.plan_stages(
        model, 2, devices=cpu_devices[:2]))
  else:
    sizes = dict(data=2, stages=2, micro_batches=2) if layout.startswith(
        "data") else dict(tensor=2)
    placed = hybrid.build_layout(model, hybrid.Layout(**sizes),
                                 devices=cpu_devices[:4])
  model.backbone.enable_lora(2)
  said = (r"model 'llama_causal_lm.*' was split into \w+ '.*' and then had "
          r"weights added or removed: 8 added \(transformer_layer_0/"
          r"self_attention/query/lora_kernel_a, .*\).*Call enable_lora\(\) "
          r".*before placing it, or split the model again")
  with pytest.raises(ValueError, match=said):
    Trainer(placed, optimizer="sgd")
  with pytest.raises(ValueError, match=said):
    placed.compile(optimizer="sgd", loss="mse")


@pytest.mark.parametrize("layout", ["1f1b2", "tensor2"])
def test_a_split_of_a_compiled_model_trains_with_its_compile(layout,
                                                             cpu_devices,
                                                             references):
  """keras_hub's flow: `lm.compile(optimizer=SGD(0.5))`, then split `lm`
  and train the split with `Trainer`: it trained with the Trainer's
  default (Adam at 1e-3, 3.7e-2 from Keras fit), silently. It now takes a
  fresh copy of the compiled optimizer, as `Trainer(lm)` does."""
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  x, y, sw = matrix.data("llama")
  model = matrix.build("llama")
  model.compile(optimizer=keras.optimizers.SGD(matrix.LR))
  placed = hybrid.build_layout(model, hybrid.Layout(**matrix.LAYOUTS[layout]),
                               devices=cpu_devices)
  trainer = Trainer(placed, verbose=0)
  assert type(trainer.optimizer).__name__ == "SGD"
  assert trainer.optimizer is not model.optimizer
  trainer.fit(x, y, sample_weight=sw, global_batch_size=matrix.BATCH,
              shuffle=False, epochs=1)
  trained = matrix.build("llama", seed=7)
  placed.copy_weights_to(trained)
  diff = max(float(np.abs(a - b).max()) for a, b in
             zip(trained.get_weights(), references("llama")))
  assert diff <= 1e-5
  assert int(model.optimizer.iterations.numpy()) == 0  # Its own untouched.


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_predict_in_a_strategy_copies_the_model_as_a_split_does(family):
  """`tfmgpu.predict(lm, x, strategy="mirrored")` copies a model built
  outside the strategy's scope into it: Keras' recursive cloning rebuilt
  each block from its own config, which failed for Llama (AttributeError
  'rope_scaling_factor') and dropped Qwen's `sliding_window_size`
  (refused). The backbone is rebuilt by its class, as a split does."""
  import tfmgpu  # pylint: disable=g-import-not-at-top
  model = matrix.build(family)
  x, _, _ = matrix.data(family)
  copy = cloning.copy_model(model)
  assert type(copy.get_layer(model.backbone.name)) is type(model.backbone)
  np.testing.assert_allclose(
      tfmgpu.predict(model, x, strategy="mirrored"),
      model.predict(x, verbose=0), atol=1e-6)


def test_bert_without_a_layout_map_is_split_by_path_rules():
  """The registry's `bert` (a BertTextClassifier from config): keras_hub's
  path rules shard its attention and MLP kernels, not its embeddings."""
  axes = layout_maps.own_axes(matrix.build("bert"), 2)
  assert axes["transformer_layer_0/self_attention_layer/query/kernel"] == 1
  assert axes["transformer_layer_1/feedforward_output_dense/kernel"] == 0
  assert not [p for p in axes if "embedding" in p]


def test_causal_lms_are_cut_between_their_blocks():
  """The backbone's token embedding, reused reversed as the tied LM head,
  no longer keeps the backbone whole."""
  graph = graph_lib.ModelGraph(matrix.build("llama"))
  assert graph.names == ["token_embedding", "transformer_layer_0",
                         "transformer_layer_1", "sequence_output_layernorm",
                         "token_embedding.2"]


def test_the_backbones_layout_map_names_the_weights_it_splits(cpu_devices):
  model = matrix.build("llama")
  mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                       ["cpu:0", "cpu:1"])
  layout_map = type(model.backbone).get_layout_map(mesh)
  axes = layout_maps.split_axes(model, layout_map)
  assert axes["transformer_layer_0/self_attention/query/kernel"] == 0
  assert axes["transformer_layer_1/feedforward_gate_dense/kernel"] == 1
  # The default keeps the embedding whole (stages cannot split it) ...
  assert "token_embedding/embeddings" not in layout_maps.own_axes(model, 2)
  # ... a map given explicitly splits it (and Llama's untied head) by
  # vocabulary, predicting as the unsplit model.
  placed = hybrid.build_layout(model, hybrid.Layout(tensor=2),
                               devices=cpu_devices[:2], layout_map=layout_map)
  vocab = placed.model.get_layer("token_embedding")
  hidden = model.backbone.hidden_dim
  assert [tuple(v.shape) for v in vocab.weights] == [
      (matrix.VOCAB // 2, hidden)] * 2 + [(hidden, matrix.VOCAB // 2)] * 2
  x, _, _ = matrix.data("llama")
  np.testing.assert_allclose(placed.predict(x, verbose=0),
                             model.predict(x, verbose=0), atol=1e-5)


def test_a_split_the_sizes_do_not_allow_names_the_weight(cpu_devices):
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.GemmaBackbone(
      vocabulary_size=64, num_layers=1, num_query_heads=3,
      num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8)
  model = keras_hub.models.GemmaCausalLM(backbone=backbone,
                                         preprocessor=None)
  with pytest.raises(ValueError, match=r"attention 'decoder_block_0/attention'"
                     r".*3 query heads, 1 key/value heads.*do not split "
                     r"over T=2"):
    hybrid.build_layout(model, hybrid.Layout(tensor=2),
                        devices=cpu_devices[:2])


def test_a_backbone_with_nothing_to_split_says_what_to_pass(cpu_devices):
  """Bloom has no layout map and other weight paths: the error said only
  `rules={} must be a non-empty mapping`."""
  backbone = keras_hub.models.BloomBackbone(
      vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=8,
      intermediate_dim=16)
  model = keras_hub.models.BloomCausalLM(backbone=backbone, preprocessor=None)
  with pytest.raises(ValueError, match=r"tensor=2 finds nothing to split.*"
                     r"Pass layout_map="):
    hybrid.build_layout(model, hybrid.Layout(tensor=2),
                        devices=cpu_devices[:2])
  # --plan_only's accounting said the GPT rules matched no layer.
  from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"tensor=2 finds nothing to split"):
    accounting.account(model, hybrid.Layout(tensor=2), global_batch_size=2)


def test_kernels_a_backbones_own_layout_leaves_whole_are_named(
    cpu_devices, caplog):
  """Mistral's map names no MLP gate: it sat whole on the first device
  (11% of the weights) without a word. A layout_map naming it splits it."""
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.MistralBackbone(
      vocabulary_size=64, num_layers=1, num_query_heads=2,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
  model = keras_hub.models.MistralCausalLM(backbone, preprocessor=None)
  hybrid.build_layout(model, hybrid.Layout(tensor=2), devices=cpu_devices[:2])
  assert ("leaves 1 Dense kernel(s) whole on the first device of each "
          "tensor group (11% "
          "of its weights): transformer_layer_0/feedforward_gate_dense/"
          "kernel") in caplog.text
  caplog.clear()
  rules = {r".*self_attention/(query|key|value)/kernel": 1,
           r".*self_attention/attention_output/kernel": 0,
           r".*feedforward_(intermediate|gate)_dense/kernel": 1,
           r".*feedforward_output_dense/kernel": 0}
  split = hybrid.build_layout(model, hybrid.Layout(tensor=2),
                              layout_map=rules, devices=cpu_devices[:2])
  assert "leaves" not in caplog.text
  x = {"token_ids": np.ones((2, 5), "int32"),
       "padding_mask": np.ones((2, 5), "int32")}
  np.testing.assert_allclose(split.predict(x, verbose=0),
                             model.predict(x, verbose=0), atol=1e-6)


def test_a_local_preset_loads_its_weights(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import hub  # pylint: disable=g-import-not-at-top
  lm = hub.causal_lm("qwen", vocabulary_size=64, sequence_length=8)
  lm.save_to_preset(str(tmp_path / "qwen"))
  hub.check_preset("qwen", str(tmp_path / "qwen"))
  model = models.build_model("qwen", input_shape=(8,), num_classes=64,
                             preset=str(tmp_path / "qwen"))
  x = np.arange(16, dtype="int32").reshape(2, 8)
  np.testing.assert_allclose(
      model.predict(x, verbose=0),
      lm.predict({"token_ids": x, "padding_mask": np.ones_like(x)},
                 verbose=0), rtol=1e-6, atol=1e-6)
  # Data whose token ids the preset's vocabulary does not hold: it failed
  # deep in TF ("GatherV2 indices ... not in [0, 64)"; zeros on a GPU).
  with pytest.raises(ValueError, match=r"model_preset='.*qwen' has "
                     r"vocabulary_size=64, but the data has num_classes=256 "
                     r"\(token ids up to 255\).*at least 256"):
    models.build_model("qwen", input_shape=(8,), num_classes=256,
                       preset=str(tmp_path / "qwen"))
  with pytest.raises(ValueError, match="no config.json"):
    hub.check_preset("qwen", str(tmp_path))
  with pytest.raises(ValueError, match="model='gpt'"):
    hub.check_preset("gpt", str(tmp_path / "qwen"))


def test_a_preset_with_fewer_positions_than_the_data_is_refused(tmp_path):
  """A new user's trial: a GPT-2 preset of 32 positions on 64-token
  windows failed deep in TF's gradient ("Paddings must be non-negative")."""
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import hub  # pylint: disable=g-import-not-at-top
  hub.causal_lm("gpt2", vocabulary_size=64, sequence_length=8).save_to_preset(
      str(tmp_path / "gpt2"))
  with pytest.raises(ValueError, match=r"model_preset='.*gpt2' has "
                     r"max_sequence_length=8 positions, but the data's "
                     r"examples are 16 tokens long: .* a preset with at least "
                     r"16 positions"):
    models.build_model("gpt2", input_shape=(16,), num_classes=64,
                       preset=str(tmp_path / "gpt2"))
  fits = models.build_model("gpt2", input_shape=(8,), num_classes=64,
                            preset=str(tmp_path / "gpt2"))
  assert fits.output_shape == (None, 8, 64)


def test_a_bert_preset_loads_its_classifier_head(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import hub  # pylint: disable=g-import-not-at-top
  clf = hub.text_classifier("bert", num_classes=3, sequence_length=8)
  clf.save_to_preset(str(tmp_path / "bert"))
  model = models.build_model("bert", input_shape=(8,), num_classes=3,
                             preset=str(tmp_path / "bert"))
  x = np.arange(16, dtype="int32").reshape(2, 8)
  np.testing.assert_allclose(
      model.predict(x, verbose=0),
      clf.predict({"token_ids": x, "segment_ids": np.zeros_like(x),
                   "padding_mask": np.ones_like(x)}, verbose=0),
      rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="holds a classifier of 3 classes but "
                     "the data has num_classes=12"):
    models.build_model("bert", input_shape=(8,), num_classes=12,
                       preset=str(tmp_path / "bert"))


def test_the_plan_counts_each_split_kernels_traffic_by_its_sides():
  """A block split Megatron's way sums twice forward (the attention's
  output, the MLP's down kernel's) and three times backward (the
  attention's input gradient; each of the MLP's two column kernels'), each
  `d` features a token: what `test_fused_blocks` reads from the step."""
  from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
  model = matrix.build("llama")
  split = accounting.path_split(model, layout_maps.own_axes(model, 2))
  block = [l for l in split.layers if l.name == "transformer_layer_0"]
  hidden = model.backbone.hidden_dim
  out = next(l for l in block
             if l.sizes == (model.backbone.num_query_heads,))
  tokens = out.output_bytes // (hidden * 4)  # Per example.
  assert tokens >= 1 and out.input_bytes == 0
  assert sum(l.output_bytes for l in block) == 2 * tokens * hidden * 4
  assert sum(l.input_bytes for l in block) == 3 * tokens * hidden * 4


_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "dog",
          "sat", "on", "mat", "a", "ran"]


def _bert_classifier(with_preprocessor: bool):
  keras.utils.set_random_seed(0)
  preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
      keras_hub.tokenizers.BertTokenizer(vocabulary=_VOCAB), sequence_length=8)
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=len(_VOCAB), num_layers=2, num_heads=2, hidden_dim=8,
      intermediate_dim=16, max_sequence_length=8, dropout=0.0)
  return keras_hub.models.BertTextClassifier(
      backbone, num_classes=2, dropout=0.0,
      preprocessor=preprocessor if with_preprocessor else None)


@pytest.mark.parametrize("detached", [False, True])
def test_a_task_with_its_preprocessor_splits_as_one_without(detached,
                                                            cpu_devices):
  """A BertTextClassifier built with its preprocessor (used once, so
  built) could not be split, even after `model.preprocessor = None`: its
  tokenizer's vocabulary was taken for state the split must copy ("holds
  state its config leaves out ..."). The split takes preprocessed inputs,
  as the model without a preprocessor does, and its unsplit form (and a
  copy) keeps the preprocessor, whose vocabulary a config leaves out."""
  texts = np.array(["the cat sat", "a dog ran on the mat", "the mat", "a cat"])
  model = _bert_classifier(with_preprocessor=True)
  x = {k: np.asarray(v) for k, v in model.preprocessor(texts).items()}
  want = model.predict(texts, verbose=0)
  if detached:
    model.preprocessor = None
  plain = _bert_classifier(with_preprocessor=False)
  plain.set_weights(model.get_weights())
  placed = hybrid.build_layout(model, hybrid.Layout(stages=2),
                               devices=cpu_devices[:2])
  np.testing.assert_allclose(placed.predict(x, verbose=0),
                             plain.predict(x, verbose=0), atol=1e-6)
  copies = [placed.to_unsplit(), cloning.copy_model(model, same_class=True)]
  for copy in copies:  # `to_unsplit`, and what serving copies.
    assert (copy.preprocessor is None) == detached
    if not detached:  # Strings, through the original's preprocessor.
      np.testing.assert_allclose(copy.predict(texts, verbose=0), want,
                                 atol=1e-6)
