"""Vocabulary-parallel embeddings and logits (Megatron-LM's).

`VocabParallelEmbedding` replaces a `keras.layers.Embedding` (or a
`ReversibleEmbedding`, keras_hub's tied LM head) with its table split by
vocabulary rows over `T` devices: shard `t` holds rows `[t V/T, (t+1) V/T)`
on `devices[t]`, looks up the ids in its range there (zero elsewhere) and
the pieces are summed on `devices[0]`, an exact sum (each id has one
non-zero piece). Called in reverse (`reverse=True`, the LM head), shard `t`
computes the logits of its vocabulary slice, `x @ table_t^T`, on its device,
and the slices are joined (concatenated) exactly on `devices[0]`, where the
soft cap and the loss run. A tied table stays one weight: the same layer
serves both ends, each shard's rows read by its lookup and its logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from tfmgpu.parallel.on_device import on_device
from tfmgpu.parallel.shards import ShardedLayer
from tfmgpu.parallel.shards import sliced_initializer
from tfmgpu.parallel.shards import split_size


@keras.saving.register_keras_serializable(package="tfmgpu")
class VocabParallelEmbedding(ShardedLayer):
  """An `Embedding` (or `ReversibleEmbedding`) split by vocabulary rows.

  `get_weights` gives the unsplit layer's (the table whole, then an untied
  reverse table whole); `from_config(get_config())` rebuilds an equal layer.
  """

  def __init__(self, input_dim: int, output_dim: int,
               devices: Sequence[str], *, reversible: bool = False,
               tie_weights: bool = True, logit_soft_cap: float | None = None,
               reverse_dtype: Any = None, mask_zero: bool = False,
               embeddings_initializer: Any = "uniform", **kwargs):
    super().__init__(devices, **kwargs)
    self.input_dim, self.output_dim = int(input_dim), int(output_dim)
    self.rows = split_size(self.input_dim, len(self.devices),
                           f"layer {self.name!r} vocabulary (input_dim)")
    self.reversible, self.tie_weights = bool(reversible), bool(tie_weights)
    self.logit_soft_cap, self.reverse_dtype = logit_soft_cap, reverse_dtype
    self.mask_zero = bool(mask_zero)
    self.embeddings_initializer = keras.initializers.get(
        embeddings_initializer)
    self._make_weights()

  def _make_weights(self) -> None:
    T, shape = len(self.devices), (self.input_dim, self.output_dim)
    inits = sliced_initializer(self.embeddings_initializer, shape, 0, T,
                               self.variable_dtype)
    self.tables = [self._add_shard_weight(
        t, f"embeddings_{t}", (self.rows, self.output_dim), inits[t])
                   for t in range(T)]
    self.reverse_tables = []
    if self.reversible and not self.tie_weights:
      inits = sliced_initializer(self.embeddings_initializer, shape[::-1], 1,
                                 T, self.variable_dtype)
      self.reverse_tables = [self._add_shard_weight(
          t, f"reverse_embeddings_{t}", (self.output_dim, self.rows),
          inits[t]) for t in range(T)]
    self.built = True

  def _lookup(self, t: int, ids):
    local = ids - t * self.rows
    inside = keras.ops.logical_and(local >= 0, local < self.rows)
    rows = keras.ops.take(self.tables[t],
                          keras.ops.where(inside, local, 0), axis=0)
    rows = keras.ops.cast(rows, self.compute_dtype)
    return rows * keras.ops.cast(inside, rows.dtype)[..., None]

  def _logits(self, t: int, x):
    kernel = (self.reverse_tables[t] if self.reverse_tables
              else keras.ops.transpose(self.tables[t]))
    if self.reverse_dtype is not None:
      x = keras.ops.cast(x, self.reverse_dtype)
      kernel = keras.ops.cast(kernel, self.reverse_dtype)
    return keras.ops.matmul(x, keras.ops.cast(kernel, x.dtype))

  def _soft_cap(self, *parts):
    logits = keras.ops.concatenate(parts, axis=-1)
    if self.logit_soft_cap is None:
      return logits
    cap = self.logit_soft_cap
    return keras.ops.multiply(keras.ops.tanh(logits / cap), cap)

  def call(self, inputs, reverse: bool = False):
    if reverse:
      parts = [on_device(d, lambda x, t=t: self._logits(t, x), inputs,
                         name=f"{self.name}_logits{t}")
               for t, d in enumerate(self.devices)]
      return on_device(self.devices[0], self._soft_cap, *parts,
                       name=f"{self.name}_logits_join")
    ids = inputs
    if ids.dtype not in ("int32", "int64"):
      ids = keras.ops.cast(ids, "int32")
    parts = [on_device(d, lambda i, t=t: self._lookup(t, i), ids,
                       name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    return on_device(self.devices[0],
                     lambda *p: keras.ops.sum(keras.ops.stack(p), axis=0),
                     *parts, name=f"{self.name}_join")

  def compute_mask(self, inputs, mask=None):
    if not self.mask_zero or self.reversible:
      return None
    return keras.ops.not_equal(inputs, 0)

  def compute_output_spec(self, inputs, reverse: bool = False):
    shape = tuple(inputs.shape[:-1]) + (self.input_dim,) if reverse else \
        tuple(inputs.shape) + (self.output_dim,)
    dtype = (self.reverse_dtype or self.compute_dtype) if reverse else \
        self.compute_dtype
    return keras.KerasTensor(shape, dtype)

  def _unsplit_layout(self):
    return [(self.tables, 0)] + (
        [(self.reverse_tables, 1)] if self.reverse_tables else [])

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(
        input_dim=self.input_dim, output_dim=self.output_dim,
        reversible=self.reversible, tie_weights=self.tie_weights,
        logit_soft_cap=self.logit_soft_cap, reverse_dtype=self.reverse_dtype,
        mask_zero=self.mask_zero,
        embeddings_initializer=keras.initializers.serialize(
            self.embeddings_initializer))
    return config
