"""keras_hub's attention layers split by heads over devices, in place.

Megatron-LM's attention: shard `t` holds the query, key and value kernels
(and biases) of its `H/T` query heads and `KV/T` key/value heads (grouped-
query attention) and its rows of the output kernel; it projects, applies
rotary embeddings, attends (scores, mask, softmax, context) and multiplies
by its output rows on `devices[t]`, forward and backward (`on_device`). The
partial outputs are summed on `devices[0]` with the output bias: one sum per
attention block.

`fuse(attention, axes, devices, named)` does it to one attention layer of a
class in `FAMILIES` (keras MultiHeadAttention and keras_hub's
`CachedMultiHeadAttention` of GPT-2 and BERT, Llama's, Qwen's, Mistral's and
Gemma's attention) whose projection kernels a layout names: its four
`EinsumDense` become `split_kernel.SplitKernelDense`s split along their
heads axis (whichever axis the layout map lays them on: keras_hub's Llama
map splits the query kernel by hidden rows, which JAX's compiler reshards;
here the attention is split by heads), and the layer's `call` runs keras_hub's
own `call` once per shard on a view of the layer whose head counts are
divided by `T` and whose projections are the shard's. So rotary embeddings,
masks and the cache logic stay keras_hub's. The layer keeps its sublayers
and weights in unsplit form (`.keras` files, `get_weights`).

A cache passed whole (`(B, 2, S, KV, head_dim)`) is split by heads for the
shards and joined again; `FusedAttention.caching(parts)` instead gives each
shard its own part, kept on its device (generation's per-head cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import split_kernel
from tfmgpu.parallel.on_device import on_device

_STATE = "_tfmgpu_fused_attention"
_HEADS_AXIS = -2  # Of a cache (B, 2, S, heads, head_dim).


@dataclasses.dataclass(frozen=True)
class Heads:
  """How one attention class names its head counts and projections.

  Attributes:
    query_heads: the attribute holding the number of query heads.
    kv_heads: the one holding the key/value heads (`query_heads` again
      without grouped-query attention).
    projections: the attributes of the query, key, value and output
      `EinsumDense`s.
    groups: the attribute holding query heads per key/value head, if the
      class keeps one.
    adjust: `(view, T)`: anything else a shard's view changes (Gemma's
      `hidden_dim`, which its unnormalised query scale divides by heads).
  """
  query_heads: str
  kv_heads: str
  projections: tuple[str, str, str, str]
  groups: str | None = None
  adjust: Callable[[Any, int], None] = lambda view, T: None


def _gemma_hidden(view: Any, T: int) -> None:
  heads = view.num_query_heads * T
  view.__dict__["hidden_dim"] = view.hidden_dim // heads * (heads // T)


_UNDERSCORED = ("_query_dense", "_key_dense", "_value_dense", "_output_dense")
_MHA = Heads("_num_heads", "_num_heads", _UNDERSCORED)
_GQA = Heads("num_query_heads", "num_key_value_heads", _UNDERSCORED,
             "num_key_value_groups")
# Class name (its module's `call` read in keras 3.15 / keras_hub 0.32) ->
# how it names its heads. A subclass with a `call` of its own is not split.
FAMILIES: dict[str, Heads] = {
    "MultiHeadAttention": _MHA,
    "CachedMultiHeadAttention": _MHA,
    "LlamaAttention": _GQA,
    "QwenAttention": _GQA,
    "CachedMistralAttention": Heads("_num_query_heads", "_num_key_value_heads",
                                    _UNDERSCORED, "_num_key_value_groups"),
    "CachedGemmaAttention": Heads(
        "num_query_heads", "num_key_value_heads",
        ("query_dense", "key_dense", "value_dense", "output_dense"),
        "num_key_value_groups", _gemma_hidden),
}


def family_of(layer: Any) -> Heads | None:
  """The `Heads` of an attention layer `fuse` splits, else `None`."""
  for cls in type(layer).__mro__:
    if cls.__name__ in FAMILIES:
      return FAMILIES[cls.__name__] if type(layer).call is cls.call else None
  return None


def _heads_axis(dense: keras.layers.EinsumDense, output: bool) -> int:
  """The kernel axis of the heads: its first letter in the product's
  output (query/key/value) or contracted with the input (output)."""
  x, k, out = split_kernel.layer_specs(dense)
  other = x if output else out
  return next(i for i, letter in enumerate(k) if letter in other)


def _split(dense: keras.layers.EinsumDense, devices: Sequence[str],
           output: bool) -> split_kernel.SplitKernelDense:
  """A projection split by heads (its bias too, except the output's)."""
  x, k, out = split_kernel.layer_specs(dense)
  axis = _heads_axis(dense, output)
  bias = getattr(dense, "bias", None)
  split = split_kernel.SplitKernelDense(
      f"{x},{k}->{out}", tuple(dense.kernel.shape), axis, devices,
      bias_shape=None if bias is None else tuple(bias.shape),
      bias_axis=None if output else split_kernel.bias_axis_of(dense, axis),
      activation=keras.activations.serialize(dense.activation),
      kernel_initializer="zeros", name=dense.name, dtype=dense.dtype_policy)
  split.set_weights(dense.get_weights())
  return split


class _Projection:
  """Piece `t` of a split projection, called as the layer was."""

  def __init__(self, split: split_kernel.SplitKernelDense, t: int,
               bias: bool):
    self.split, self.t, self.bias = split, t, bias

  def __call__(self, x, *args, **kwargs):
    del args, kwargs  # training=: no dropout in a projection.
    return self.split.shard_product(self.t, x, bias=self.bias)


@dataclasses.dataclass(frozen=True)
class _Counts:
  """Heads per shard: `T` shards; `shared` shards read one key/value head
  (1 when `T` divides the key/value heads)."""
  query: int
  kv: int
  shared: int


def _view(layer: Any, heads: Heads, t: int, counts: _Counts,
          splits: Sequence[split_kernel.SplitKernelDense]) -> Any:
  """Shard `t`'s view of `layer`: its attributes, head counts the shard's,
  projections the shard's pieces (never tracked: not a sublayer)."""
  view = object.__new__(type(layer))
  view.__dict__.update(layer.__dict__)
  view.__dict__.pop("call", None)
  view.__dict__.pop(_STATE, None)
  view.__dict__[heads.kv_heads] = counts.kv
  view.__dict__[heads.query_heads] = counts.query
  if heads.groups:
    view.__dict__[heads.groups] = counts.query // counts.kv
  pieces = (t, t // counts.shared, t // counts.shared, t)
  for i, (name, split) in enumerate(zip(heads.projections, splits)):
    view.__dict__[name] = _Projection(split, pieces[i], bias=i < 3)
  heads.adjust(view, len(splits[0].devices))
  return view


class FusedAttention:
  """The state of one attention layer split by heads (`fuse`).

  Attributes:
    devices: the `T` shards' devices.
    kv_heads: key/value heads per shard (a cache part's heads).
  """

  def __init__(self, layer: Any, heads: Heads,
               splits: Sequence[split_kernel.SplitKernelDense],
               counts: _Counts):
    self.devices = splits[0].devices
    self.kv_heads, self.shared = counts.kv, counts.shared
    self.views = [_view(layer, heads, t, counts, splits)
                  for t in range(len(self.devices))]
    self.output_bias = splits[3].bias
    self._parts: list[Any] | None = None
    self._written: list[Any] = []

  @contextlib.contextmanager
  def caching(self, parts: Sequence[Any]) -> Iterator[list[Any]]:
    """While open, shard `t` reads and writes cache `parts[t]` (on its
    device, `(B, 2, S, kv_heads, head_dim)`) whatever cache the layer is
    given; the list yielded receives the written parts."""
    self._parts, self._written = list(parts), []
    try:
      yield self._written
    finally:
      self._parts = None

  def _cache_parts(self, cache: Any) -> list[Any] | None:
    if self._parts is not None:
      return self._parts
    if cache is None:
      return None
    return [on_device(d, lambda c, s=t // self.shared * self.kv_heads: c[
        ..., s:s + self.kv_heads, :], cache, name=f"cache_part{t}")
            for t, d in enumerate(self.devices)]

  def call(self, *args, **kwargs):
    """The layer's `call`: keras_hub's, once per shard, then one sum.

    Raises:
      ValueError: `return_attention_scores=True` (each shard has its
        heads' scores only).
    """
    if kwargs.get("return_attention_scores"):
      raise ValueError(
          "return_attention_scores=True on an attention split by heads over "
          f"{len(self.devices)} devices: each shard holds its own heads' "
          "scores only. Call it without return_attention_scores, or keep "
          "this attention unsplit (drop its kernels from the layout map).")
    cache = kwargs.pop("cache", None)
    parts = self._cache_parts(cache)
    outs = []
    for t, device in enumerate(self.devices):
      own = {} if parts is None else {"cache": parts[t]}
      outs.append(_run_shard(self.views[t], device, args,
                             dict(kwargs, **own), f"attention_shard{t}"))
    if parts is None:
      return self._reduce([o for o in outs])
    y = self._reduce([o[0] for o in outs])
    written = [o[1] for o in outs]  # Shards sharing a head: the first's.
    if self._parts is not None:
      self._written[:] = written
      return y, cache
    return y, on_device(self.devices[0], lambda *w: keras.ops.concatenate(
        w, axis=_HEADS_AXIS), *written[::self.shared], name="cache_join")

  def _reduce(self, outs: list[Any]) -> Any:
    def add(*parts):
      y = tf.add_n(list(parts))
      if self.output_bias is not None:
        y = keras.ops.add(y, keras.ops.cast(self.output_bias, y.dtype))
      return y
    return on_device(self.devices[0], add, *outs, name="attention_sum")


def _run_shard(view: Any, device: str, args: tuple, kwargs: dict,
               name: str) -> Any:
  """`view.call(*args, **kwargs)` on `device` (forward and backward), the
  tensors among the arguments passed through `on_device`."""
  flat = tf.nest.flatten((args, kwargs))
  where = [i for i, v in enumerate(flat) if tf.is_tensor(v)]

  def run(*tensors):
    values = list(flat)
    for i, v in zip(where, tensors):
      values[i] = v
    a, k = tf.nest.pack_sequence_as((args, kwargs), values)
    return view.call(*a, **k)

  return on_device(device, run, *[flat[i] for i in where], name=name)


def fused_in(layer: Any) -> FusedAttention | None:
  """The `FusedAttention` of the first attention layer inside `layer`
  (any depth) that `fuse` split, else `None`."""
  for sub in _compat.flatten_layers(layer):
    state = vars(sub).get(_STATE)
    if state is not None:
      return state
  return None


def _refuse_heads(path: str, layer: Any, heads: Heads, T: int) -> ValueError:
  q, kv = getattr(layer, heads.query_heads), getattr(layer, heads.kv_heads)
  return ValueError(
      f"the tensor-parallel layout names the attention {path!r} "
      f"({type(layer).__name__}: {q} query heads, {kv} key/value heads) but "
      f"tfmgpu splits attention by heads and they do not split over "
      f"T={T}: the query heads must be divisible by T, and the key/value "
      f"heads divisible by T or dividing it (then shards share one). Use "
      "such a tensor size, or drop its kernels from the layout map (or "
      "rules).")


def _counts(layer: Any, heads: Heads, T: int) -> _Counts | None:
  """Heads per shard, or `None`: `T` does not split them."""
  q, kv = getattr(layer, heads.query_heads), getattr(layer, heads.kv_heads)
  if q % T or (kv % T and T % kv):
    return None
  shared = 1 if kv % T == 0 else T // kv
  return _Counts(q // T, kv * shared // T, shared)


def fuse(layer: Any, axes: Mapping[str, int], devices: Sequence[str],
         named: Mapping[int, str]
         ) -> list[tuple[keras.layers.Layer, keras.layers.Layer]]:
  """Splits attention `layer` by heads over `devices`, in place, if `axes`
  names any of its projection kernels (`named`: weight id -> the path
  `axes` uses). With fewer key/value heads than shards (`T` a multiple of
  them), each key/value head is held once, on the first shard that reads
  it, and read by the others (one weight; its gradient the sum of theirs),
  each keeping its own cache of it.

  Returns:
    `[(projection, its split)]` (empty: not named, nothing done).

  Raises:
    ValueError: `T` does not split its heads (named by the attention's
      path, with its head counts).
  """
  heads = family_of(layer)
  dense = [getattr(layer, name, None) for name in heads.projections]
  if any(not isinstance(d, keras.layers.EinsumDense) for d in dense):
    return []
  paths = [named.get(id(layer_state.variable(d, "kernel"))) for d in dense]
  if not any(p in axes for p in paths):
    return []
  for d, path in zip(dense, paths):
    layer_state.refuse_split(d, path or d.name)
  if _compat.attention_gated(layer):
    raise ValueError(
        f"the tensor-parallel layout names the attention "
        f"{next(p for p in paths if p).rsplit('/', 2)[0]!r} "
        f"({type(layer).__name__}), built with use_gate=True: tfmgpu does "
        "not split its gate by heads. Build it without use_gate, or drop its "
        "kernels from the layout map (or rules).")
  counts = _counts(layer, heads, len(devices))
  if counts is None:
    path = next(p for p in paths if p).rsplit("/", 2)[0]
    raise _refuse_heads(path, layer, heads, len(devices))
  owners = list(devices)[::counts.shared]  # Of the key/value heads.
  splits = [_split(d, owners if i in (1, 2) else devices, output=i == 3)
            for i, d in enumerate(dense)]
  for d, split in zip(dense, splits):
    _compat.replace_sublayer(layer, d, split)
  state = FusedAttention(layer, heads, splits, counts)
  object.__setattr__(layer, _STATE, state)
  object.__setattr__(layer, "call", state.call)
  return list(zip(dense, splits))
