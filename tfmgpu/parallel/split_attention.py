"""`keras.layers.MultiHeadAttention` with its heads split over devices.

Shard `t` projects queries, keys and values for its `H/T` heads, attends,
and multiplies by its rows of the output kernel; the partial outputs are
summed on `devices[0]` with the output bias: one sum forward, one sum of
the inputs' gradients backward, per attention block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel.on_device import on_device
from tfmgpu.parallel.shards import ShardedLayer
from tfmgpu.parallel.shards import sliced_initializer
from tfmgpu.parallel.shards import split_size


@keras.saving.register_keras_serializable(package="tfmgpu")
class HeadParallelAttention(ShardedLayer):
  """`keras.layers.MultiHeadAttention` with its heads split over devices.

  Shard `t` (on `devices[t]`) holds the query, key and value kernels and
  biases of its `num_heads / T` heads and their rows of the output kernel;
  it projects, attends (Keras' `ops.dot_product_attention`, scaled by
  `1/sqrt(key_dim)`, as `MultiHeadAttention` does) and projects out. The
  partial outputs are summed on `devices[0]` with the output bias. Inputs
  of shape `(B, T, d)`; masks as `MultiHeadAttention`'s: the Keras masks
  of the inputs (`Embedding(mask_zero=True)`), `attention_mask` and
  `use_causal_mask`, combined as it does; the inputs' masks cleared and
  the output given the query's, as it does. No dropout.
  """

  def __init__(self, num_heads: int, key_dim: int, devices: Sequence[str],
               *, value_dim: int | None = None, dropout: float = 0.0,
               use_bias: bool = True,
               kernel_initializer: Any = "glorot_uniform",
               bias_initializer: Any = "zeros", **kwargs):
    super().__init__(devices, **kwargs)
    self.supports_masking = True  # The output keeps the query's mask.
    if dropout:
      raise ValueError(
          f"HeadParallelAttention {self.name!r} got dropout={dropout!r}; "
          "split attention does not support dropout. Use dropout=0 (gpt: "
          "the default) or leave this layer unsplit.")
    self.num_heads, self.key_dim = int(num_heads), int(key_dim)
    self.value_dim = int(value_dim) if value_dim else self.key_dim
    self.dropout = 0.0
    self.use_bias = bool(use_bias)
    self.shard_heads = split_size(self.num_heads, len(self.devices),
                                    f"layer {self.name!r} num_heads")
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, query_shape, value_shape, key_shape=None):
    T, H = len(self.devices), self.num_heads
    dq, dv = int(query_shape[-1]), int(value_shape[-1])
    dk = int((key_shape or value_shape)[-1])
    shapes = {"query": ((dq, H, self.key_dim), 1),
              "key": ((dk, H, self.key_dim), 1),
              "value": ((dv, H, self.value_dim), 1),
              "output": ((H, self.value_dim, dq), 0)}
    self.shards = [{} for _ in range(T)]
    for part, (shape, axis) in shapes.items():
      kernels = sliced_initializer(self.kernel_initializer, shape, axis, T,
                                    self.variable_dtype)
      for t in range(T):
        piece = list(shape)
        piece[axis] //= T
        self.shards[t][f"{part}_kernel"] = self._add_shard_weight(
            t, f"{part}_kernel_{t}", piece, kernels[t])
        if self.use_bias and part != "output":
          self.shards[t][f"{part}_bias"] = self._add_shard_weight(
              t, f"{part}_bias_{t}", piece[1:], self.bias_initializer)
    self.output_bias = None
    if self.use_bias:
      self.output_bias = self._add_shard_weight(0, "output_bias", (dq,),
                                                self.bias_initializer)

  def _project(self, shard: dict[str, Any], part: str, x, equation: str):
    y = keras.ops.einsum(equation, x,
                         keras.ops.cast(shard[f"{part}_kernel"], x.dtype))
    if self.use_bias and part != "output":
      y = keras.ops.add(y, keras.ops.cast(shard[f"{part}_bias"], y.dtype))
    return y

  def _shard(self, t: int, query, key, value, *mask, is_causal: bool):
    shard = self.shards[t]
    q = self._project(shard, "query", query, "abc,cde->abde")
    k = self._project(shard, "key", key, "abc,cde->abde")
    v = self._project(shard, "value", value, "abc,cde->abde")
    out = keras.ops.dot_product_attention(
        q, k, v, mask=mask[0] if mask else None,
        scale=1.0 / math.sqrt(float(self.key_dim)), is_causal=is_causal)
    return self._project(shard, "output", out, "abcd,cde->abe")

  def _reduce(self, *parts):
    y = tf.add_n(list(parts))
    if self.use_bias:
      y = keras.ops.add(y, keras.ops.cast(self.output_bias, y.dtype))
    return y

  def call(self, query, value, key=None, query_mask=None, value_mask=None,
           key_mask=None, attention_mask=None, use_causal_mask=False,
           training=None):
    # Keras fills `value_mask` and `key_mask` from the inputs' Keras masks.
    # As `MultiHeadAttention.call`: the query's mask is its tensor's (an
    # argument is ignored), and the inputs' masks are cleared, so a later
    # layer reading the same tensors (the residual `Add([x, attention(x)])`)
    # sees none; the output takes the query's.
    del query_mask, training  # No dropout.
    key = value if key is None else key
    query_mask = _compat.get_keras_mask(query)
    for x in (query, value, key):
      _compat.set_keras_mask(x, None)
    mask = _attention_mask(query, value, attention_mask, use_causal_mask,
                           (query_mask, value_mask, key_mask))
    is_causal = bool(use_causal_mask) and mask is None
    extra = [] if mask is None else [mask]
    parts = [on_device(d, lambda q, k, v, *m, t=t: self._shard(
        t, q, k, v, *m, is_causal=is_causal), query, key, value, *extra,
                       name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    output = on_device(self.devices[0], self._reduce, *parts,
                       name=f"{self.name}_reduce")
    if query_mask is not None:
      _compat.set_keras_mask(output, query_mask)
    return output

  def compute_output_spec(self, query, value, key=None, query_mask=None,
                          value_mask=None, key_mask=None, attention_mask=None,
                          use_causal_mask=False, training=None):
    del value, key, query_mask, value_mask, key_mask, attention_mask
    del use_causal_mask, training
    return keras.KerasTensor(tuple(query.shape), self.compute_dtype)

  def _unsplit_layout(self):
    layout = []
    for part in ("query", "key", "value", "output"):
      layout.append(([s[f"{part}_kernel"] for s in self.shards],
                     0 if part == "output" else 1))
      if self.use_bias:
        layout.append(([s[f"{part}_bias"] for s in self.shards], 0)
                      if part != "output" else ([self.output_bias], None))
    return layout

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(
        num_heads=self.num_heads, key_dim=self.key_dim,
        value_dim=self.value_dim, dropout=self.dropout,
        use_bias=self.use_bias,
        kernel_initializer=keras.initializers.serialize(
            self.kernel_initializer),
        bias_initializer=keras.initializers.serialize(self.bias_initializer))
    return config


def _attention_mask(query, value, attention_mask, use_causal_mask,
                    input_masks=(None, None, None)):
  """`MultiHeadAttention`'s mask, `(B, 1, T, S)` bool: the inputs' Keras
  masks (`input_masks`: the query's as `(B, T, 1)`, the value's and key's
  as `(B, 1, S)`), `attention_mask` and the causal mask, all ANDed; `None`
  when only the causal mask applies (then the kernel's `is_causal` does
  it, as Keras does)."""
  query_mask, *value_masks = input_masks
  masks = [] if query_mask is None else [
      keras.ops.expand_dims(keras.ops.cast(query_mask, "bool"), -1)]
  masks += [keras.ops.expand_dims(keras.ops.cast(m, "bool"), -2)
            for m in value_masks if m is not None]
  if attention_mask is not None:
    masks.append(keras.ops.cast(attention_mask, "bool"))
  if not masks:
    return None
  mask = functools.reduce(keras.ops.logical_and, masks)
  if use_causal_mask:
    q_len, v_len = keras.ops.shape(query)[1], keras.ops.shape(value)[1]
    ones = keras.ops.ones((1, q_len, v_len), dtype="int32")
    causal = keras.ops.greater_equal(keras.ops.cumsum(ones, axis=-2),
                                     keras.ops.cumsum(ones, axis=-1))
    mask = keras.ops.logical_and(mask, causal)
  while len(mask.shape) < 4:
    mask = keras.ops.expand_dims(mask, axis=-3)
  return mask
