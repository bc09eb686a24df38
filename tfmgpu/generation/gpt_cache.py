"""A KV cache for tfmgpu's `gpt`: prefill once, then one token per step.

The cache is one `(B, length, heads, head_dim)` tensor of keys and one of
values per block. `prefill` runs the prompt through every block and writes
the keys and values of its positions; `step` embeds one token at a
position, attends over the cached keys up to it (a causal mask: right-
padded prompts never reach their padding) and returns its logits. Shapes
never change from step to step and the cache is written with a one-hot
mask, so a compiled step traces once and compiles with XLA.

The model's own layers are called (layer norms, the attention's query/key/
value/output projections, the MLP, the logits), found by their stable
names (see `tfmgpu.models.gpt`).
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

_NEG = -1e9  # Added to masked scores (Keras' masked softmax does the same).


def is_gpt(model: Any) -> bool:
  """Whether `model` has `gpt`'s layer names (`block0_attention`, ...)."""
  names = {layer.name for layer in getattr(model, "layers", [])}
  return {"token_embedding", "position_embedding", "block0_attention",
          "final_ln", "logits"} <= names


class GPTCache:
  """Cached decoding of a `gpt` built by `tfmgpu.models.gpt` (a
  `decode.CacheAdapter`).

  Args:
    model: the functional `gpt` (unplaced).

  Attributes:
    max_positions: the position embedding's rows: no sequence is longer.
    vocab: the logits' width.
  """

  def __init__(self, model: Any):
    self.model = model
    get = model.get_layer
    self.token_embedding = get("token_embedding")
    self.position_embedding = get("position_embedding")
    self.final_ln = get("final_ln")
    self.logits = get("logits")
    self.blocks = []
    while any(l.name == f"block{len(self.blocks)}_attention"
              for l in model.layers):
      i = len(self.blocks)
      self.blocks.append({part: get(f"block{i}_{part}") for part in (
          "ln1", "attention", "ln2", "mlp_up", "mlp_down")})
    attention = self.blocks[0]["attention"]
    self.num_heads = attention.num_heads
    self.head_dim = attention.key_dim
    self.max_positions = int(self.position_embedding.max_length)
    self.vocab = int(self.logits.units)
    self.dtype = self.token_embedding.compute_dtype

  def empty_cache(self, batch: int, length: int) -> tuple[tf.Tensor, ...]:
    """Zero keys and values for every block: `2 * num_layers` tensors."""
    shape = (batch, length, self.num_heads, self.head_dim)
    return tuple(tf.zeros(shape, self.dtype) for _ in range(2 * len(
        self.blocks)))

  def _embed(self, token_ids: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
    table = tf.cast(self.position_embedding.embeddings, self.dtype)
    return self.token_embedding(token_ids) + tf.gather(table, positions)

  def prefill(self, token_ids: tf.Tensor, cache: tuple[tf.Tensor, ...]
              ) -> tuple[tf.Tensor, ...]:
    """The cache with the keys/values of positions `[0, T)` written.

    Args:
      token_ids: `(B, T)` int prompts (right-padded), `T <= length`.
      cache: from `empty_cache(B, length)` (its contents are replaced).
    """
    width = token_ids.shape[1]
    length = cache[0].shape[1]

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
    length = cache[0].shape[1]
    at = tf.one_hot(index, length, dtype=self.dtype)[None, :, None, None]

    def write(old, new):  # One position replaced; shapes never change.
      return old + at * (new - old)

    x = self._embed(token[:, None], index[None])
    x, cache = self._blocks(x, cache, index[None], write)
    x = self.final_ln(x)
    return self.logits(x)[:, 0, :], cache

  def _blocks(self, x, cache, positions, write):
    """Every block on `x` (B, S, D) at `positions` (S,), keys and values
    written into the cache by `write(old, new)`."""
    new_cache = []
    for i, block in enumerate(self.blocks):
      attention = block["attention"]
      h = block["ln1"](x)
      keys = write(cache[2 * i], attention.key_dense(h))
      values = write(cache[2 * i + 1], attention.value_dense(h))
      new_cache += [keys, values]
      o = _attend(attention.query_dense(h), keys, values, positions,
                  1.0 / math.sqrt(self.head_dim))
      x = x + attention.output_dense(o)
      h = block["mlp_down"](block["mlp_up"](block["ln2"](x)))
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
