"""Generation on placed models: the cache where each layer lives.

A model placed by `tfmgpu.parallel.hybrid.build_layout` is one copy
(`StagedModel`, `PipelinedModel`, `TensorParallelModel`) or several
(`ReplicatedModel`). Each copy is read through its layers with weights
(`weighted_layers()`, the unsplit model's names): `gpt_cache.GPTCache`
runs every layer on the device of its weights, so a stage's blocks keep
their cache on the stage's device and a head-split attention keeps each
shard's keys and values on the shard's device; a keras_hub causal LM's
copy is decoded block by block by `hub_blocks.PlacedHubCache`, each
block's cache on its device.

`RowGroups` joins copies: the request's rows are split over the copies
(data parallelism), and within a pipeline's copy into one group per stage,
each with its own cache: the groups are independent in the step's graph,
so TF's executor runs group 2 on stage 1 while group 1 is on stage 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfmgpu.generation import gpt_cache
from tfmgpu.generation import hub_blocks
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import replicated


def _copy_adapter(copy: Any) -> Any:
  """The cache adapter of one placed copy: `PlacedHubCache` for a keras_hub
  causal LM's, `GPTCache` for a `gpt`'s.

  Raises:
    ValueError: a copy of neither.
  """
  if hub_blocks.is_hub_copy(copy):
    return hub_blocks.PlacedHubCache(copy)
  layers = copy.weighted_layers()
  if not set(gpt_cache.LAYER_NAMES) <= set(layers):
    raise ValueError(
        f"model {copy.name!r} is placed over devices ({type(copy).__name__})"
        " but is neither tfmgpu's gpt nor a keras_hub CausalLM: generation "
        "on placed models reads gpt's layers (token_embedding, "
        "block0_attention, ...) or a keras_hub CausalLM's blocks. Generate "
        "other models unplaced (`model.to_unsplit()`).")
  return gpt_cache.GPTCache(copy, layers, placed=True)


def placed_adapter(model: Any) -> Any:
  """The cache adapter of a placed model: a `GPTCache` for one copy that
  is not a pipeline, else `RowGroups` over its copies and stages."""
  copies = (model.replicas if isinstance(model, replicated.ReplicatedModel)
            else [model])
  adapters = [_copy_adapter(c) for c in copies]
  groups = [len(c.stages) if isinstance(c, pipeline.PipelinedModel) else 1
            for c in copies]
  if len(adapters) == 1 and groups[0] == 1:
    return adapters[0]
  return RowGroups(adapters, groups)


class RowGroups:
  """Several cache adapters, each decoding its own rows (a
  `decode.CacheAdapter`).

  Args:
    adapters: one per copy; copy `r` takes share `r` of the rows.
    groups: per copy, how many groups its share is split into (each with
      its own cache: a pipeline's stages then work on different groups at
      once). A share smaller than that has one group per row.

  The split depends only on the batch size, so the cache (a tuple of each
  group's cache) has the same structure at prefill and at every step.
  """

  def __init__(self, adapters: Sequence[Any], groups: Sequence[int]):
    self.adapters = list(adapters)
    self.groups = list(groups)
    self.max_positions = self.adapters[0].max_positions
    self.vocab = self.adapters[0].vocab

  def _split(self, batch: int) -> list[tuple[Any, int]]:
    """`(adapter, rows)` of each non-empty group, in row order."""
    out = []
    shares = microbatch.near_equal(batch, len(self.adapters))
    for adapter, share, groups in zip(self.adapters, shares, self.groups):
      out += [(adapter, n)
              for n in microbatch.near_equal(share, min(groups, share) or 1)
              if n]
    return out

  def empty_cache(self, batch: int, length: int) -> tuple[Any, ...]:
    return tuple(a.empty_cache(n, length) for a, n in self._split(batch))

  def prefill(self, token_ids: tf.Tensor, cache: tuple[Any, ...]
              ) -> tuple[Any, ...]:
    split = self._split(token_ids.shape[0])
    rows = tf.split(token_ids, [n for _, n in split])
    return tuple(a.prefill(r, c) for (a, _), r, c in zip(split, rows, cache))

  def step(self, token: tf.Tensor, cache: tuple[Any, ...], index: tf.Tensor
           ) -> tuple[tf.Tensor, tuple[Any, ...]]:
    split = self._split(token.shape[0])
    rows = tf.split(token, [n for _, n in split])
    outs = [a.step(r, c, index) for (a, _), r, c in zip(split, rows, cache)]
    return (tf.concat([logits for logits, _ in outs], 0),
            tuple(c for _, c in outs))
