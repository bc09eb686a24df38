"""Generation on placed `gpt`s: tensor 2, pipeline 2 (with and without
micro-batches), pipeline 2 x tensor 2 and data 2 x tensor 2 give the
unplaced tokens (greedy and seeded top-k), trace the decode loop once per
sampler, and keep each shard's cache and matmuls on its device."""

import re

import numpy as np
import pytest

import tfmgpu
from tfmgpu import devices as devices_lib
from tfmgpu import generation
from tfmgpu import models
from tfmgpu.parallel import hybrid

VOCAB = 50
NEW = 6
TOP_K = {"sampler": "top_k", "k": 5, "seed": 7}
LAYOUTS = {
    "tensor2": hybrid.Layout(tensor=2),
    "pipeline2": hybrid.Layout(stages=2),
    "pipeline2_micro2": hybrid.Layout(stages=2, micro_batches=2),
    "data2_tensor2": hybrid.Layout(data=2, tensor=2),
    "pipeline2_tensor2": hybrid.Layout(stages=2, tensor=2),
}


@pytest.fixture(scope="module")
def gpt():
  return models.build_model("gpt", input_shape=(24,), num_classes=VOCAB,
                            seed=3)


@pytest.fixture(scope="module")
def prompts():
  lengths = (5, 2, 8)
  ids = np.random.RandomState(0).randint(1, VOCAB, (3, 8))
  mask = np.arange(8)[None, :] < np.array(lengths)[:, None]
  return {"token_ids": (ids * mask).astype(np.int32), "padding_mask": mask}


@pytest.fixture(scope="module")
def unplaced(gpt, prompts):
  return {name: tfmgpu.generate(gpt, prompts, max_new_tokens=NEW, **options)
          for name, options in (("greedy", {}), ("top_k", TOP_K))}


@pytest.fixture(scope="module")
def generators(gpt):
  cpus = tfmgpu.list_devices("CPU")
  return {name: generation.Generator(hybrid.build_layout(
      gpt, layout, devices=cpus[:layout.num_devices]))
          for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_placed_tokens_equal_unplaced(name, generators, prompts, unplaced):
  generator = generators[name]
  for sampler, options in (("greedy", {}), ("top_k", TOP_K)):
    sampling = generation.Sampling(**options)
    for _ in range(2):  # The second request reuses the traced loop.
      out = generator.generate(prompts, max_new_tokens=NEW,
                               sampling=sampling)
      for key in ("token_ids", "padding_mask"):
        np.testing.assert_array_equal(out[key], unplaced[sampler][key])
  assert generator.traces == 2  # One per sampler, not per token.


def _ops(graph):
  """`(nodes, functions)`: a graph's and its functions' nodes (the decode
  loop's body is a function of the graph), and `{function name: its node
  op types}`."""
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node) + [
      n for f in graph_def.library.function for n in f.node_def]
  functions = {f.signature.name: {n.op for n in f.node_def}
               for f in graph_def.library.function}
  return nodes, functions


def _called(node, functions):
  """The op types a call node runs (its function's), else its own."""
  if "f" in node.attr and node.attr["f"].func.name in functions:
    return functions[node.attr["f"].func.name]
  return {node.op}


def _expected(name, cpus):
  """`{(block, group): device}`: where each block's heads should be."""
  layout = LAYOUTS[name]
  mesh = layout.mesh(cpus)[0]
  stage_of = {0: 0, 1: layout.stages - 1}  # gpt tiny: 2 blocks.
  return {(b, g): mesh[stage_of[b]][g] for b in (0, 1)
          for g in range(layout.tensor)}


@pytest.mark.parametrize("name", ["tensor2", "pipeline2_tensor2"])
def test_each_shard_keeps_its_cache_and_matmuls_on_its_device(
    name, generators, prompts):
  generator = generators[name]
  # The shape of test_placed_tokens_equal_unplaced's: its trace, if run.
  generator.generate(prompts, max_new_tokens=NEW)
  nodes, functions = _ops(generator.graphs[-1])
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")]
  ops = {n.name: devices_lib.canonical_device(n.device) for n in nodes
         if n.device}
  for (block, group), device in _expected(name, cpus).items():
    scope = re.compile(rf"(^|/)block{block}/heads{group}/")
    mine = [n for n in nodes if scope.search(n.name)]
    kinds = set().union(*(_called(n, functions) for n in mine))
    # Key/value/query projections, the cache writes and the attention
    # (each shard's decode step is one XLA call on its device).
    assert {"Einsum", "Softmax"} <= kinds, (block, group, sorted(kinds))
    assert {ops.get(n.name) for n in mine} == {device}, (block, group)
    # The split MLP's matmuls are on the shard's device too.
    mlp = {d for n, d in ops.items() if re.search(
        rf"block{block}/block{block}_mlp_up\w*/block{block}_mlp_up_shard"
        rf"{group}/.*MatMul$", n)}
    assert mlp == {device}, (block, group, mlp)


def test_a_stage_decodes_its_blocks_in_one_compiled_call_on_its_device(
    generators, prompts):
  generator = generators["pipeline2"]
  # The shape of test_placed_tokens_equal_unplaced's: its trace, if run.
  generator.generate(prompts, max_new_tokens=NEW)
  graph_def = generator.graphs[-1].as_graph_def()
  nodes = list(graph_def.node) + [
      n for f in graph_def.library.function for n in f.node_def]
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")]
  for block, device in ((0, cpus[0]), (1, cpus[1])):
    calls = [n for n in nodes if re.search(rf"(^|/)block{block}/", n.name)
             and n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    assert calls and {devices_lib.canonical_device(n.device)
                      for n in calls} == {device}, (block, calls)


def test_a_vocabulary_parallel_gpt_generates_the_unsplit_tokens(
    gpt, prompts, unplaced):
  """The token table split by vocabulary rows and the LM head by columns
  (`split_embedding.VocabParallelEmbedding`): the same greedy and seeded
  tokens as the unsplit model, the decode loop traced once per sampler."""
  from tfmgpu.parallel import split_embedding  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  placed = hybrid.build_layout(
      gpt, hybrid.Layout(tensor=2), devices=tfmgpu.list_devices("CPU")[:2],
      rules=tensor.GPT_RULES,
      layout_map={r"^token_embedding/embeddings$": 0, r"^logits/kernel$": 1})
  assert any(isinstance(l, split_embedding.VocabParallelEmbedding)
             for l in placed.model.layers)
  generator = generation.Generator(placed)
  for sampler, options in (("greedy", {}), ("top_k", TOP_K)):
    out = generator.generate(prompts, max_new_tokens=NEW,
                             sampling=generation.Sampling(**options))
    for key in ("token_ids", "padding_mask"):
      np.testing.assert_array_equal(out[key], unplaced[sampler][key])
  assert generator.traces == 2
