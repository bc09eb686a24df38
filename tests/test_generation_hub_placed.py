"""Generation on placed keras_hub causal LMs: tiny GPT-2, Llama (grouped-
query, rotary) and Gemma under pipeline 2 and tensor 2, and Llama under
data 2 x tensor 2, give keras_hub's own greedy tokens; seeded top-k
gives the unplaced tokens on every layout; each block's cache is written
on its device."""

import re

import numpy as np
import pytest

import tfmgpu
from tfmgpu import devices as devices_lib
from tfmgpu import generation
from tfmgpu.parallel import hybrid

keras_hub = pytest.importorskip("keras_hub")

VOCAB = 64
NEW = 3
TOP_K = {"sampler": "top_k", "k": 5, "seed": 7}
LAYOUTS = {
    "pipeline2": hybrid.Layout(stages=2),
    "tensor2": hybrid.Layout(tensor=2),
    "data2_tensor2": hybrid.Layout(data=2, tensor=2),
}


def _lm(name):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  if name == "gpt2":
    return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=32), preprocessor=None)
  sizes = dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
               num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
  if name == "gemma":
    return keras_hub.models.GemmaCausalLM(keras_hub.models.GemmaBackbone(
        head_dim=8, **sizes), preprocessor=None)
  return keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(
      **sizes), preprocessor=None)


@pytest.fixture(scope="module")
def prompts():
  lengths = (5, 2, 8)
  ids = np.random.RandomState(0).randint(1, VOCAB, (3, 8))
  mask = np.arange(8)[None, :] < np.array(lengths)[:, None]
  return {"token_ids": (ids * mask).astype(np.int32), "padding_mask": mask}


@pytest.fixture(scope="module")
def lms():
  return {name: _lm(name) for name in ("gpt2", "llama", "gemma")}


@pytest.fixture(scope="module")
def generators(lms):
  """`(model, layout) -> Generator`, built on first use."""
  cpus = tfmgpu.list_devices("CPU")
  made = {}

  def get(name, layout):
    if (name, layout) not in made:
      spec = LAYOUTS[layout]
      made[name, layout] = generation.Generator(hybrid.build_layout(
          lms[name], spec, devices=cpus[:spec.num_devices]))
    return made[name, layout]

  return get


@pytest.fixture(scope="module")
def keras_hub_greedy(lms, prompts):
  """`name -> keras_hub's own generate`: each row's prompt and `NEW`
  tokens, made once per model (every layout compares with it)."""
  made = {}

  def get(name):
    if name not in made:
      wide = {k: np.pad(v, [(0, 0), (0, 16)]) for k, v in prompts.items()}
      lms[name].compile(sampler="greedy")
      theirs = lms[name].generate(wide, stop_token_ids=None)["token_ids"]
      lengths = prompts["padding_mask"].sum(axis=1)
      made[name] = [list(row[:n + NEW]) for row, n in zip(theirs, lengths)]
    return made[name]

  return get


def _rows(out):
  return [list(row[mask]) for row, mask in zip(out["token_ids"],
                                               out["padding_mask"])]


# Each family under pipeline 2 and tensor 2 (its own embedding, head split
# and cache arguments); data 2 x tensor 2 with Llama only: its copies split
# the rows (`placed.RowGroups`, the same for every family) and each copy
# runs its family's tensor 2 path, which the tensor2 cases cover.
@pytest.mark.parametrize("name,layout", [
    (name, layout) for name in ("gpt2", "llama", "gemma")
    for layout in ("pipeline2", "tensor2")] + [("llama", "data2_tensor2")])
def test_placed_greedy_equals_keras_hub_generate(name, layout, generators,
                                                  prompts, keras_hub_greedy):
  out = generators(name, layout).generate(prompts, max_new_tokens=NEW)
  assert _rows(out) == keras_hub_greedy(name)


def test_a_zero_sharded_lm_generates_as_unsharded(prompts):
  """A trial: a ShardedModel of a Gemma was refused as "neither tfmgpu's
  gpt nor a keras_hub CausalLM"; it decodes with the model it shards."""
  from tfmgpu.parallel import zero  # pylint: disable=g-import-not-at-top
  want = tfmgpu.generate(_lm("gemma"), prompts, max_new_tokens=NEW, **TOP_K)
  sharded = zero.ShardedModel(_lm("gemma"), tfmgpu.list_devices("CPU")[:2],
                              stage=3)
  got = tfmgpu.generate(sharded, prompts, max_new_tokens=NEW, **TOP_K)
  for key in ("token_ids", "padding_mask"):
    np.testing.assert_array_equal(got[key], want[key])


def test_seeded_top_k_is_the_same_on_every_layout(lms, generators,
                                                  prompts):
  unplaced = tfmgpu.generate(lms["llama"], prompts, max_new_tokens=NEW,
                             **TOP_K)
  sampling = generation.Sampling(**TOP_K)
  for layout in LAYOUTS:
    out = generators("llama", layout).generate(
        prompts, max_new_tokens=NEW, sampling=sampling)
    for key in ("token_ids", "padding_mask"):
      np.testing.assert_array_equal(out[key], unplaced[key], err_msg=layout)


def _kinds(graph_def):
  """`(nodes, kinds)`: a graph's and its functions' nodes, and
  `kinds(node)`: the op types it runs (a call node: its function's, and
  theirs in turn; a block's decode step is one XLA call on its device)."""
  functions = {f.signature.name: f for f in graph_def.library.function}

  def kinds(node, seen=()):
    name = node.attr["f"].func.name if "f" in node.attr else None
    if name not in functions or name in seen:
      return {node.op}
    return set().union(*(kinds(n, seen + (name,))
                         for n in functions[name].node_def))

  nodes = list(graph_def.node) + [
      n for f in graph_def.library.function for n in f.node_def]
  return nodes, kinds


@pytest.mark.parametrize("layout", ["pipeline2", "tensor2"])
def test_each_block_writes_its_cache_on_its_device(layout, generators,
                                                   prompts):
  generator = generators("llama", layout)
  generator.generate(prompts, max_new_tokens=NEW)
  nodes, kinds = _kinds(generator.graphs[-1].as_graph_def())
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")]

  def devices(block, kind, shard=""):
    return {devices_lib.canonical_device(n.device) for n in nodes
            if re.search(rf"(^|/)block{block}/.*{shard}", n.name)
            and n.device and kinds(n) & kind}

  writes = {"XlaDynamicUpdateSlice"}  # The cache write.
  products = {"Einsum", "MatMul", "BatchMatMulV2"}
  for block in (0, 1):
    if layout == "pipeline2":  # Block b on stage b, all of it.
      assert devices(block, writes) == devices(block, products) == {
          cpus[block]}, block
      continue
    for t in (0, 1):  # Shard t's heads: cache, projections, scores.
      shard = f"attention_shard{t}/"
      assert devices(block, writes, shard) == {cpus[t]}, (block, t)
      assert devices(block, products, shard) == {cpus[t]}, (block, t)
  # The cache parts never cross devices (never split or joined).
  assert not [n.name for n in nodes if re.search(r"cache_(part|join)",
                                                  n.name)]


def test_each_shard_keeps_the_cache_of_its_key_value_heads(generators):
  """Llama's 2 key/value heads under tensor 2: each block's cache is one
  part per shard, of its 1 head, made on the shard's device."""
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")]
  cache = generators("llama", "tensor2").adapter.empty_cache(3, 8)
  assert len(cache) == 2  # Blocks.
  for parts in cache:
    assert [tuple(p.shape) for p in parts] == [(3, 2, 8, 1, 4)] * 2
    assert [devices_lib.canonical_device(p.device) for p in parts] == \
        cpus[:2]


def test_the_registry_wrapper_generates_placed_as_unplaced(prompts):
  """`--model=llama` wraps the CausalLM in a functional model: generation
  finds it inside, unplaced and placed."""
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  wrapper = models.build_model("llama", input_shape=(16,),
                               num_classes=VOCAB, size="tiny", seed=0)
  placed = hybrid.build_layout(wrapper, LAYOUTS["pipeline2"],
                               devices=tfmgpu.list_devices("CPU")[:2])
  ids = prompts["token_ids"][:2, :2]  # Two rows, all prompt.
  unplaced = tfmgpu.generate(wrapper, ids, max_new_tokens=NEW)
  out = tfmgpu.generate(placed, ids, max_new_tokens=NEW)
  np.testing.assert_array_equal(out["token_ids"], unplaced["token_ids"])
