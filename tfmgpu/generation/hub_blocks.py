"""keras_hub `CausalLM`s placed over devices, decoded block by block.

A keras_hub causal LM placed by `tfmgpu.parallel.hybrid.build_layout` is
rebuilt as stages or shards of plain functional models: the task's
`call_with_cache` is gone, but its decoder blocks are still keras_hub's
blocks (copies, their Dense kernels possibly split over tensor shards by
`parallel.split_blocks`), and a block takes its own cache in its call
(`self_attention_cache` / `self_attention_cache_update_index` for GPT-2,
Llama, Mistral and Qwen; `cache` / `cache_update_index` for Gemma).

`PlacedHubCache` replays the task's `call_with_cache` on a placed copy's
layers (`weighted_layers()`, named as in the unsplit backbone): the
embedding (`Family.embed`: GPT-2 adds learned positions, Gemma scales by
`sqrt(hidden_dim)`), then each block on the device of its weights with a
cache of its own `(B, 2, length, kv_heads, head_dim)` made there, the final
norm, and the token embedding reversed (the LM head) on the device of its
weights. So a pipeline stage keeps its blocks' caches; under tensor
parallelism a block's attention is split by heads
(`parallel.split_hub_attention`): its cache is one part per shard, of the
shard's key/value heads, made on the shard's device, and each shard reads
and writes its part there (`FusedAttention.caching`; the part never
crosses devices), beside its projections, rotary, scores and context. A
decode step of a block whose
weights are all on one device is one XLA-compiled call there (4.6x the
tokens/s of op-by-op on a 4-block Llama, pipeline 2, logical CPUs).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu.generation.hub_cache import cache_sizes
from tfmgpu.parallel import cloning
from tfmgpu.parallel import split_hub_attention

Layers = Mapping[str, Any]


def _token_only(layers: Layers, token_ids: tf.Tensor, index: Any
                ) -> tf.Tensor:
  del index  # Rotary positions are applied inside the blocks.
  return layers["token_embedding"](token_ids)


def _with_positions(layers: Layers, token_ids: tf.Tensor, index: Any
                    ) -> tf.Tensor:
  tokens = layers["token_embedding"](token_ids)
  return tokens + layers["position_embedding"](tokens, start_index=index)


def _scaled(layers: Layers, token_ids: tf.Tensor, index: Any) -> tf.Tensor:
  del index
  embedding = layers["token_embedding"]
  x = embedding(token_ids)
  return x * keras.ops.cast(keras.ops.sqrt(embedding.output_dim), x.dtype)


@dataclasses.dataclass(frozen=True)
class Family:
  """How one keras_hub task's `call_with_cache` reads its backbone.

  Attributes:
    block: the name of block `i` (`str.format` of `i`).
    final_norm: the name of the norm before the LM head.
    cache_args: the block call's keyword arguments for its cache and the
      position the input starts at.
    embed: `(layers, token_ids, index) -> x`, the inputs of block 0.
  """
  block: str
  final_norm: str
  cache_args: tuple[str, str]
  embed: Callable[[Layers, tf.Tensor, Any], tf.Tensor]


_SELF = ("self_attention_cache", "self_attention_cache_update_index")
_LLAMA = Family("transformer_layer_{}", "sequence_output_layernorm", _SELF,
                _token_only)
# Task class name -> family, each read from keras_hub 0.32's
# `call_with_cache` of that class.
FAMILIES: dict[str, Family] = {
    "GPT2CausalLM": Family("transformer_layer_{}", "layer_norm", _SELF,
                           _with_positions),
    "LlamaCausalLM": _LLAMA,
    "MistralCausalLM": _LLAMA,
    "QwenCausalLM": _LLAMA,
    "GemmaCausalLM": Family("decoder_block_{}", "final_normalization",
                            ("cache", "cache_update_index"), _scaled),
}


def _task_of(spec: cloning.ModelSpec) -> tuple[str, dict] | None:
  """`(class name, config)` of the keras_hub causal LM the unsplit model
  is, or wraps as one of its layers (`tfmgpu.models.hub`'s wrapper for
  `--model=llama` and the like); `None`: neither."""
  if callable(getattr(spec.cls, "call_with_cache", None)):
    return spec.cls.__name__, spec.config
  for layer in spec.config.get("layers", ()):
    if layer.get("class_name") in FAMILIES:
      return layer["class_name"], layer["config"]
  return None


def is_hub_copy(copy: Any) -> bool:
  """Whether a placed copy is a keras_hub causal LM's (or a wrapper's)."""
  return (isinstance(copy, cloning.UnsplitWeights)
          and _task_of(copy.unsplit_spec) is not None)


def _device_of_weight(weight: Any) -> str:
  return getattr(weight, "value", weight).device


def _device_of(layer: Any) -> str:
  return _device_of_weight(layer.weights[0])


class PlacedHubCache:
  """Cached decoding of one placed copy of a keras_hub `CausalLM`, block
  by block (a `decode.CacheAdapter`).

  Args:
    copy: a `StagedModel`, `PipelinedModel` or `TensorParallelModel` of a
      keras_hub causal LM, or of a model wrapping one (one data copy of a
      `ReplicatedModel`).

  Raises:
    ValueError: a task class not in `FAMILIES`.
  """

  def __init__(self, copy: Any):
    task, config = _task_of(copy.unsplit_spec)
    family = FAMILIES.get(task)
    if family is None:
      raise ValueError(
          f"model {copy.name!r} is a placed keras_hub {task}; "
          "generation on placed keras_hub models replays the "
          f"call_with_cache of {sorted(FAMILIES)} only. Generate it "
          "unplaced (`model.to_unsplit()`) or with strategy='mirrored'.")
    self.family = family
    sizes = cache_sizes(config["backbone"]["config"].get)
    self.kv_heads, self.head_dim = sizes["kv_heads"], sizes["head_dim"]
    self.max_positions, self.vocab = sizes["max_positions"], sizes["vocab"]
    self.layers = copy.weighted_layers()
    self.blocks = [self.layers[family.block.format(i)]
                   for i in range(sizes["num_layers"])]
    self.homes = [_device_of(b) for b in self.blocks]
    self.fused = [split_hub_attention.fused_in(b) for b in self.blocks]
    # A block whose weights are all on one device (a pipeline stage's)
    # decodes in one XLA-compiled call there; a block with split kernels
    # runs op by op (XLA compiles for one device).
    self.compiled = [tf.function(self._call(b), jit_compile=True)
                     if len({_device_of_weight(w) for w in b.weights}) == 1
                     else None for b in self.blocks]
    self.dtype = self.layers["token_embedding"].compute_dtype

  def _call(self, block: Any) -> Callable[..., Any]:
    cache_arg, index_arg = self.family.cache_args
    return lambda x, own, index: block(x, **{cache_arg: own,
                                             index_arg: index})

  def _on(self, name: str):
    layer = self.layers.get(name)
    return tf.device(_device_of(layer)) if layer is not None else (
        contextlib.nullcontext())

  def empty_cache(self, batch: int, length: int) -> tuple[Any, ...]:
    """A zero cache per block, on the block's device; a block whose
    attention is split by heads has one per shard, of the shard's key/value
    heads, on the shard's device."""
    out = []
    for home, fused in zip(self.homes, self.fused):
      parts = []
      for device, heads in ([(home, self.kv_heads)] if fused is None else
                            [(d, fused.kv_heads) for d in fused.devices]):
        with tf.device(device):
          parts.append(tf.zeros((batch, 2, length, heads, self.head_dim),
                                self.dtype))
      out.append(parts[0] if fused is None else tuple(parts))
    return tuple(out)

  def _block(self, i: int, x, own, index, step: bool):
    """Block `i` on `x` with its cache `own` (a tuple of the shards' parts
    for a block whose attention is split by heads: each shard reads and
    writes its own, the block given the first part for its shape)."""
    call = (self.compiled[i] if step and self.compiled[i] is not None
            else self._call(self.blocks[i]))
    fused = self.fused[i]
    if fused is None:
      return call(x, own, index)
    with fused.caching(own) as written:
      x, _ = call(x, own[0], index)
    return x, tuple(written)

  def _forward(self, token_ids, cache, index, step=False):
    """The blocks' output for `token_ids` starting at `index`, and the
    cache with their keys and values written (`step`: one token, by the
    compiled calls where there are some)."""
    with self._on("token_embedding"):
      x = self.family.embed(self.layers, token_ids, index)
    written = []
    for i, (home, own) in enumerate(zip(self.homes, cache)):
      with tf.device(home), tf.name_scope(f"block{i}"):
        x, own = self._block(i, x, own, index, step)
      written.append(own)
    return x, tuple(written)

  def prefill(self, token_ids: tf.Tensor, cache: tuple[tf.Tensor, ...]
              ) -> tuple[tf.Tensor, ...]:
    """The caches with the keys/values of positions `[0, T)` written."""
    return self._forward(token_ids, cache, 0)[1]

  def step(self, token: tf.Tensor, cache: tuple[tf.Tensor, ...],
           index: tf.Tensor) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
    """`(logits (B, vocab), caches)` of one token per row at `index`."""
    x, cache = self._forward(token[:, None], cache, index, step=True)
    with self._on(self.family.final_norm):
      x = self.layers[self.family.final_norm](x)
    with self._on("token_embedding"):
      logits = self.layers["token_embedding"](x, reverse=True)
    return logits[:, 0, :], cache
