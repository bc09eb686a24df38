"""keras_hub blocks under tensor 2 run Megatron's split, read from the
traced training step: each shard's attention (its q/k/v/o kernel products,
scores, softmax and context) and MLP on its device, forward and backward,
and the bytes crossing devices those of one sum per attention and per MLP.
"""

import importlib.util
import pathlib

import keras
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import generation
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import hybrid
from tfmgpu.parallel import inspection

pytest.importorskip("keras_hub")

_SPEC = importlib.util.spec_from_file_location(
    "hub_matrix", pathlib.Path(__file__).parents[2] / "scripts" /
    "hub_matrix.py")
matrix = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(matrix)

PRODUCTS = ("Einsum", "MatMul", "BatchMatMulV2")


@pytest.fixture(scope="module")
def steps():
  """`family -> (model, the traced step of its tensor-2 copy)`."""
  cpu_devices = tfmgpu.list_devices("CPU")
  out = {}
  for family in ("llama", "gpt2"):  # Grouped-query + rotary; keras MHA.
    model = matrix.build(family)
    placed = hybrid.build_layout(model, hybrid.Layout(tensor=2),
                                 devices=cpu_devices[:2])
    x, y, _ = matrix.data(family)
    x = {k: v[:matrix.BATCH] for k, v in x.items()}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = tf.function(lambda xb, yb, p=placed: p.compute_loss_and_gradients(
        xb, yb, loss)[2])
    out[family] = model, step.get_concrete_function(x, y[:matrix.BATCH])
  return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_shards_attention_and_mlp_run_on_its_device(family, steps,
                                                         cpu_devices):
  _, step = steps[family]
  ops = inspection.op_placements(step)
  cpus = [devices_lib.canonical_device(d) for d in cpu_devices[:2]]
  for t in (0, 1):
    for part, least in (("attention_shard", 6), ("dense_shard", 2)):
      mine = [p for p in ops if f"{part}{t}" in p.name]
      forward = [p for p in mine if p.type in PRODUCTS
                 and not p.name.startswith("gradient_tape/")]
      softmax = [p for p in mine if p.type == "Softmax"]
      backward = [p for p in mine if p.type in PRODUCTS
                  and p.name.startswith("gradient_tape/")]
      # Per block: q, k, v, o and the scores and context (attention); the
      # MLP's 2-3 kernels (each `*_dense_shard{t}`).
      assert len(forward) >= 2 * least, (part, t, len(forward))
      assert len(backward) >= len(forward)
      assert softmax or part != "attention_shard"
      assert {p.device for p in forward + backward + softmax} == {cpus[t]}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_block_sends_one_sum_per_attention_and_per_mlp(family, steps):
  """Per block, what a tensor-2 step must move, in activations `(B, S, d)`:
  forward, the input to shard 1 and its partial sum back, for attention
  and for the MLP (4), and the attention mask; backward, the output's
  gradient to shard 1 and the input's gradient back for each (4; the
  MLP's two column kernels send theirs apart: 5). A join per kernel, as
  before the fusion, moved 2.7x this (Llama: 204800 bytes)."""
  model, step = steps[family]
  backbone = model.backbone
  activation = matrix.BATCH * matrix.LENGTH * backbone.hidden_dim * 4
  mask = matrix.BATCH * matrix.LENGTH * matrix.LENGTH * 4
  sent = inspection.cross_device_bytes(step)
  per_block = 9 * activation + mask
  assert sum(sent.values()) <= backbone.num_layers * per_block + 64, sent


def _one_kv_head_gemma(family="gemma", seed=0):
  del family
  import keras_hub  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(seed)
  return keras_hub.models.GemmaCausalLM(keras_hub.models.GemmaBackbone(
      vocabulary_size=matrix.VOCAB, num_layers=2, num_query_heads=2,
      num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
      head_dim=8), preprocessor=None)


def test_shards_share_a_key_value_head_when_t_is_a_multiple(monkeypatch,
                                                            cpu_devices):
  """Gemma with 1 key/value head under tensor 2: the head is one weight on
  shard 0, read by shard 1 too (its gradient the sum of both reads); it
  trains as one-device `fit`, and generates the unsplit model's greedy tokens
  with each shard caching the head on its own device."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(matrix, "build", _one_kv_head_gemma)
  predicted, diff = matrix.run_case("gemma", "tensor2", cpu_devices)
  assert predicted <= 1e-5 and diff <= 1e-5
  lm = _one_kv_head_gemma(seed=1)
  placed = hybrid.build_layout(lm, hybrid.Layout(tensor=2),
                               devices=cpu_devices[:2])
  key = [v for v in placed.weights if v.path.endswith("key/kernel_0")]
  assert [tuple(v.shape) for v in key] == [(1, 16, 8)] * 2  # One a block.
  ids = np.random.RandomState(0).randint(1, matrix.VOCAB, (2, 4))
  prompts = {"token_ids": ids.astype("int32"),
             "padding_mask": np.ones_like(ids, bool)}
  generator = generation.Generator(placed)
  cache = generator.adapter.empty_cache(2, 8)
  cpus = [devices_lib.canonical_device(d) for d in cpu_devices[:2]]
  assert [[devices_lib.canonical_device(p.device) for p in parts]
          for parts in cache] == [cpus] * 2
  out = generator.generate(prompts, max_new_tokens=3)["token_ids"]
  want = ids.astype("int32")  # Greedy by recomputing, eagerly (no trace).
  for _ in range(3):
    logits = lm({"token_ids": want, "padding_mask": np.ones_like(want)})
    want = np.concatenate([want, np.argmax(logits[:, -1], -1)[:, None]], 1)
  np.testing.assert_array_equal(out[:, :7], want)
