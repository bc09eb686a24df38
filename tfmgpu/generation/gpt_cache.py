"""A KV cache for tfmgpu's `gpt`: prefill once, then one token per step.

The cache holds one `(B, length, heads, head_dim)` tensor of keys and one
of values per block and per group of heads. `prefill` runs the prompt
through every block and writes the keys and values of its positions;
`step` embeds one token at a position, attends over the cached keys up to
it (a causal mask: right-padded prompts never reach their padding) and
returns its logits. Shapes never change from step to step and the cache
is written with a one-hot mask, so a compiled step traces once and
compiles with XLA.

The model's own layers are called (layer norms, the attention's query/key/
value/output projections, the MLP, the logits), found by their stable
names (see `tfmgpu.models.gpt`). A placed `gpt` (a stage, or a copy of a
tensor-parallel layout) is read the same way: each layer runs on the
device of its weights, so each stage's blocks keep their cache there;
an attention split by heads (`tensor.HeadParallelAttention`) gives one
group per shard, whose keys, values and matmuls stay on its device, and
the shards' outputs are summed on its first device as in training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable

import tensorflow as tf

from tfmgpu.generation import decode

_NEG = -1e9  # Added to masked scores (Keras' masked softmax does the same).

LAYER_NAMES = ("token_embedding", "position_embedding", "block0_attention",
               "final_ln", "logits")


def is_gpt(model: Any) -> bool:
  """Whether `model` has `gpt`'s layer names (`block0_attention`, ...)."""
  names = {layer.name for layer in getattr(model, "layers", [])}
  return set(LAYER_NAMES) <= names


@dataclasses.dataclass(frozen=True)
class HeadGroup:
  """Some heads of one attention layer, on one device.

  Attributes:
    device: where their projections, cache and attention run (`None`:
      the caller's device).
    query, key, value: `(B, S, D) -> (B, S, heads, head_dim)`.
    output: `(B, S, heads, head_dim) -> (B, S, D)`, this group's share of
      the attention's output.
  """
  device: str | None
  query: Callable[[tf.Tensor], tf.Tensor]
  key: Callable[[tf.Tensor], tf.Tensor]
  value: Callable[[tf.Tensor], tf.Tensor]
  output: Callable[[tf.Tensor], tf.Tensor]
  heads: int


def _on(device: str | None):
  return tf.device(device) if device else contextlib.nullcontext()


def _split_head_groups(layer: Any) -> tuple[list[HeadGroup], Callable]:
  """One group per shard of a `tensor.HeadParallelAttention`, and the sum
  of their outputs (with the output bias) on its first device.

  Reads the layer's shard variables (`layer.shards[t]`, `layer.devices`):
  the one place that knows how a split attention holds its heads."""
  def project(shard, part, equation):
    def run(x):
      y = tf.einsum(equation, x, tf.cast(shard[f"{part}_kernel"], x.dtype))
      bias = shard.get(f"{part}_bias")
      return y if bias is None else y + tf.cast(bias, y.dtype)
    return run

  groups = [HeadGroup(device, project(s, "query", "abc,cde->abde"),
                      project(s, "key", "abc,cde->abde"),
                      project(s, "value", "abc,cde->abde"),
                      project(s, "output", "abcd,cde->abe"),
                      layer.shard_heads)
            for device, s in zip(layer.devices, layer.shards)]

  def combine(parts):
    with tf.device(layer.devices[0]):
      y = tf.add_n(parts)
      bias = layer.output_bias
      return y if bias is None else y + tf.cast(bias, y.dtype)

  return groups, combine


def head_groups(layer: Any, device: str | None
                ) -> tuple[list[HeadGroup], Callable]:
  """`(groups, combine)` of an attention layer: a Keras
  `MultiHeadAttention` is one group on `device`; a head-split one, a group
  per shard. `combine(outputs)` sums the groups' outputs."""
  if hasattr(layer, "shards"):  # tensor.HeadParallelAttention.
    return _split_head_groups(layer)
  return ([HeadGroup(device, layer.query_dense, layer.key_dense,
                     layer.value_dense, layer.output_dense,
                     layer.num_heads)], lambda parts: parts[0])


def _split(block: Mapping[str, Any]) -> bool:
  """Whether a block's MLP is split over devices (tensor parallelism)."""
  return any(hasattr(block[part], "devices") for part in ("mlp_up",
                                                          "mlp_down"))


def _device_of(layer: Any) -> str:
  """The device of a layer's first weight."""
  weight = layer.weights[0]
  return getattr(weight, "value", weight).device


class GPTCache:
  """Cached decoding of a `gpt` built by `tfmgpu.models.gpt` (a
  `decode.CacheAdapter`).

  Args:
    model: the functional `gpt` (unplaced), or a placed copy of one.
    layers: `{name: layer}` of the model's layers with weights (a placed
      model's `weighted_layers()`). Defaults to `model.get_layer`.
    placed: run each layer on the device of its weights (a placed
      model). Defaults to `False`: every op on the caller's device.

  Attributes:
    max_positions: the position embedding's rows: no sequence is longer.
    vocab: the logits' width.
    row_groups: 1 (one cache for every row).
  """
  row_groups = 1

  def __init__(self, model: Any, layers: Mapping[str, Any] | None = None,
               *, placed: bool = False):
    self.model = model
    get = layers.__getitem__ if layers is not None else model.get_layer
    self._device = _device_of if placed else (lambda layer: None)
    self.token_embedding = get("token_embedding")
    self.position_embedding = get("position_embedding")
    self.final_ln = get("final_ln")
    self.logits = get("logits")
    names = set(layers) if layers is not None else {
        l.name for l in model.layers}
    self.blocks = []
    while f"block{len(self.blocks)}_attention" in names:
      i = len(self.blocks)
      block = {part: get(f"block{i}_{part}") for part in (
          "ln1", "attention", "ln2", "mlp_up", "mlp_down")}
      attention = block["attention"]
      block["groups"], block["combine"] = head_groups(
          attention, self._device(attention))
      # A placed block whose layers all run on one device (a pipeline
      # stage's) decodes in one XLA-compiled call there.
      block["compiled"] = (tf.function(
          self._one_device_step(block), jit_compile=True)
                           if placed and len(block["groups"]) == 1
                           and not _split(block) else None)
      # Split heads: each shard's part of a decode step, compiled on its
      # device.
      block["group_steps"] = [
          tf.function(self._group_step(g), jit_compile=True)
          for g in block["groups"]] if placed and len(
              block["groups"]) > 1 else None
      self.blocks.append(block)
    attention = self.blocks[0]["attention"]
    self.head_dim = attention.key_dim
    self.max_positions = int(self.position_embedding.max_length)
    # A `Dense`, or its kernel split by vocabulary (`SplitKernelDense`).
    self.vocab = int(getattr(self.logits, "units", None)
                     or self.logits.kernel_shape[-1])
    self.dtype = self.token_embedding.compute_dtype

  def _call(self, layer: Any, x: tf.Tensor) -> tf.Tensor:
    """`layer(x)` on the device of its weights (placed models)."""
    with _on(self._device(layer)):
      return layer(x)

  def empty_cache(self, batch: int, length: int) -> tuple[tf.Tensor, ...]:
    """Zero keys and values for every block and group of heads, each on
    its group's device."""
    cache = []
    for block in self.blocks:
      for group in block["groups"]:
        shape = (batch, length, group.heads, self.head_dim)
        with _on(group.device):
          cache += [tf.zeros(shape, self.dtype), tf.zeros(shape, self.dtype)]
    return tuple(cache)

  def _embed(self, token_ids: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
    with _on(self._device(self.position_embedding)):
      table = tf.cast(self.position_embedding.embeddings, self.dtype)
      return self._call(self.token_embedding, token_ids) + tf.gather(
          table, positions)

  def prefill(self, token_ids: tf.Tensor, cache: tuple[tf.Tensor, ...]
              ) -> tuple[tf.Tensor, ...]:
    """The cache with the keys/values of positions `[0, T)` written.

    Args:
      token_ids: `(B, T)` int prompts (right-padded), `T <= length`.
      cache: from `empty_cache(B, length)` (its contents are replaced).
    """
    width, length = decode.dim(token_ids, 1), decode.dim(cache[0], 1)

    def write(_, new):  # From empty: the new keys, then zeros.
      return tf.pad(new, [[0, 0], [0, length - width], [0, 0], [0, 0]])

    x = self._embed(token_ids, tf.range(width))
    _, cache = self._blocks(x, cache, tf.range(width), write)
    return cache

  def step(self, token: tf.Tensor, cache: tuple[tf.Tensor, ...],
           index: tf.Tensor) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
    """`(logits (B, vocab), cache)` of one token per row at `index`.

    Args:
      token: `(B,)` int token ids, each at position `index`.
      cache: the cache, holding the keys/values of positions before `index`.
      index: a scalar int tensor.
    """
    length = decode.dim(cache[0], 1)

    def write(old, new):  # One position replaced; shapes never change.
      at = tf.one_hot(index, length, dtype=old.dtype)[None, :, None, None]
      return old + at * (new - old)

    x = self._embed(token[:, None], index[None])
    x, cache = self._blocks(x, cache, index[None], write, index=index)
    x = self._call(self.final_ln, x)
    return self._call(self.logits, x)[:, 0, :], cache

  def _one_device_step(self, block):
    """`(x, keys, values, index) -> (x, keys, values)`: one block's decode
    step of one token, all of it on one device (to compile with XLA)."""
    group = block["groups"][0]

    def step(x, keys, values, index):
      scale = 1.0 / math.sqrt(self.head_dim)
      h = block["ln1"](x)
      at = tf.one_hot(index, tf.shape(keys)[1], dtype=keys.dtype)
      at = at[None, :, None, None]
      keys = keys + at * (group.key(h) - keys)
      values = values + at * (group.value(h) - values)
      o = _attend(group.query(h), keys, values, index[None], scale)
      x = x + block["combine"]([group.output(o)])
      return x + block["mlp_down"](block["mlp_up"](block["ln2"](x))), keys, \
          values

    return step

  def _group_step(self, group: HeadGroup):
    """`(h, keys, values, index) -> (keys, values, output)`: one group of
    heads' decode step of one token (to compile on its device)."""

    def step(h, keys, values, index):
      at = tf.one_hot(index, tf.shape(keys)[1], dtype=keys.dtype)
      at = at[None, :, None, None]
      keys = keys + at * (group.key(h) - keys)
      values = values + at * (group.value(h) - values)
      o = _attend(group.query(h), keys, values, index[None],
                  1.0 / math.sqrt(self.head_dim))
      return keys, values, group.output(o)

    return step

  def _blocks(self, x, cache, positions, write, index=None):
    """Every block on `x` (B, S, D) at `positions` (S,), keys and values
    written into the cache by `write(old, new)`; a decode step (`index`)
    runs a block's compiled step where it has one."""
    new_cache, scale = [], 1.0 / math.sqrt(self.head_dim)
    slot = iter(cache)
    for i, block in enumerate(self.blocks):
      home = _on(self._device(block["ln1"]))
      if index is not None and block["compiled"] is not None:
        with home, tf.name_scope(f"block{i}"):
          x, keys, values = block["compiled"](x, next(slot), next(slot),
                                              index)
        new_cache += [keys, values]
        continue
      with home, tf.name_scope(f"block{i}"):
        h = block["ln1"](x)
        parts = []
        for g, group in enumerate(block["groups"]):
          with _on(group.device), tf.name_scope(f"heads{g}"):
            if index is not None and block["group_steps"]:
              keys, values, out = block["group_steps"][g](
                  h, next(slot), next(slot), index)
              new_cache += [keys, values]
              parts.append(out)
              continue
            keys = write(next(slot), group.key(h))
            values = write(next(slot), group.value(h))
            new_cache += [keys, values]
            o = _attend(group.query(h), keys, values, positions, scale)
            parts.append(group.output(o))
        x = x + block["combine"](parts)
        h = self._call(block["mlp_down"], self._call(
            block["mlp_up"], self._call(block["ln2"], x)))
        x = x + h
    return x, tuple(new_cache)


def _attend(query, keys, values, positions, scale) -> tf.Tensor:
  """Causal attention of `query` (B, S, H, d) at `positions` over every
  cached position (B, L, H, d): a key counts when its position is at most
  the query's."""
  scores = tf.einsum("bshd,blhd->bhsl", query * scale, keys)
  visible = tf.range(tf.shape(keys)[1])[None, :] <= positions[:, None]
  scores = tf.where(visible[None, None], scores,
                    tf.cast(_NEG, scores.dtype))
  weights = tf.nn.softmax(scores, axis=-1)
  return tf.einsum("bhsl,blhd->bshd", weights, values)
