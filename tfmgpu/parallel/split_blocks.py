"""The weights a layout names, split inside a model's layers, in place.

`split_layers(layer, axes, devices)` splits, inside `layer` (any depth: a
keras_hub block), what `axes` (`{variable path: axis}`, read from a
`LayoutMap` by `layout_maps`) names, Megatron-style:

* an attention layer of a class `split_hub_attention.FAMILIES` knows
  (keras MultiHeadAttention, keras_hub's GPT-2/BERT, Llama, Qwen, Mistral
  and Gemma attention) whose projection kernels it names is split by heads:
  shard `t` runs keras_hub's own attention `call` for its query and
  key/value heads (projections, rotary, mask, scores, softmax, context,
  its rows of the output kernel; its part of the KV cache) on `devices[t]`,
  and the parts are summed once on `devices[0]`;
* every other `Dense` / `EinsumDense` kernel it names becomes a
  `split_kernel.SplitKernelDense`: split along an output axis (an MLP's up
  and gate kernels), each shard adds its bias slice and the activation;
  split along a contracted axis (the down kernel), each shard replays the
  block's elementwise gating on the column parts it holds
  (`split_mlp`) and multiplies by its rows, so an MLP costs one sum;
* an `Embedding` / `ReversibleEmbedding` table it names (by vocabulary
  rows) becomes a `split_embedding.VocabParallelEmbedding` (a keras_hub
  tied LM head with it: one layer, one table).

Normalisation, residual adds and the block's other elementwise work run
whole on the block's device (`devices[0]`). A split block still gives and
takes its weights in unsplit form (`get_weights` / `set_weights` in the
original order; `.keras` files hold its sublayers unsplit), so weights move
between layouts by layer name as for every tfmgpu placement. A weight
`axes` names that cannot be split (another layer type, an axis that `T`
does not divide, attention heads `T` does not split) is refused with its
path.

`transform` does it while `tensor.tensor_parallel` rebuilds a model;
`split_stages` in a staged or pipelined model's stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import keras

from tfmgpu import _compat
from tfmgpu.parallel import cloning
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import split_embedding
from tfmgpu.parallel import split_hub_attention
from tfmgpu.parallel import split_kernel
from tfmgpu.parallel import tensor


def _refuse(path: str, layer: keras.layers.Layer, why: str) -> ValueError:
  return ValueError(
      f"the tensor-parallel layout names weight {path!r} (layer "
      f"{layer.name!r}, {type(layer).__name__}) but tfmgpu cannot split it: "
      f"{why}. Drop it from the layout map (or rules), or use a tensor size "
      "that divides it.")


def _split_dense(layer: keras.layers.Layer, path: str, axis: int,
                 devices: Sequence[str]) -> split_kernel.SplitKernelDense:
  """The split copy of one Dense / EinsumDense (its kernel at `path`)."""
  shape = tuple(layer.kernel.shape)
  if shape[axis] % len(devices):
    raise _refuse(path, layer, f"its axis {axis} of size {shape[axis]} is "
                  f"not divisible by T={len(devices)}")
  x, k, out = split_kernel.layer_specs(layer)
  bias = getattr(layer, "bias", None)
  split = split_kernel.SplitKernelDense(
      f"{x},{k}->{out}", shape, axis, devices,
      bias_shape=None if bias is None else tuple(bias.shape),
      bias_axis=split_kernel.bias_axis_of(layer, axis),
      activation=keras.activations.serialize(layer.activation),
      kernel_initializer="zeros", name=layer.name, dtype=layer.dtype_policy)
  split.set_weights(layer.get_weights())
  return split


def _split_embedding(layer: keras.layers.Layer, path: str, axis: int,
                     devices: Sequence[str]
                     ) -> split_embedding.VocabParallelEmbedding:
  """The vocabulary-parallel copy of one Embedding / ReversibleEmbedding."""
  if axis != 0:
    raise _refuse(path, layer, f"an embedding splits by vocabulary rows "
                  f"(axis 0) only, not axis {axis}")
  if layer.input_dim % len(devices):
    raise _refuse(path, layer, f"its vocabulary of {layer.input_dim} is "
                  f"not divisible by T={len(devices)}")
  reversible = isinstance(layer, keras.layers.ReversibleEmbedding)
  split = split_embedding.VocabParallelEmbedding(
      layer.input_dim, layer.output_dim, devices, reversible=reversible,
      tie_weights=getattr(layer, "tie_weights", True),
      logit_soft_cap=getattr(layer, "logit_soft_cap", None),
      reverse_dtype=getattr(layer, "reverse_dtype", None),
      mask_zero=layer.mask_zero, embeddings_initializer="zeros",
      name=layer.name, dtype=layer.dtype_policy)
  split.set_weights(layer.get_weights())
  return split


# Layer type -> (the attribute of the weight a layout names, its splitter).
# A subclass that keeps its base's `call` (keras_hub's ReversibleEmbedding)
# splits as its base.
_SPLITTERS: dict[type, tuple[str, Callable[..., keras.layers.Layer]]] = {
    keras.layers.Dense: ("kernel", _split_dense),
    keras.layers.EinsumDense: ("kernel", _split_dense),
    keras.layers.Embedding: ("embeddings", _split_embedding),
    keras.layers.ReversibleEmbedding: ("embeddings", _split_embedding),
}


def _splitter(layer: keras.layers.Layer) -> tuple[str, Callable] | None:
  for cls in type(layer).__mro__:
    if cls in _SPLITTERS:
      return _SPLITTERS[cls] if type(layer).call is cls.call else None
  return None


def _splits(layer: keras.layers.Layer, axes: Mapping[str, int],
            devices: Sequence[str], named: Mapping[int, str]
            ) -> list[tuple[keras.layers.Layer, keras.layers.Layer]]:
  """`[(sublayer, its split copy)]` of the sublayers whose weight `axes`
  names (any depth; `layer` itself included)."""
  out, fused = [], set()
  for sub in _compat.flatten_layers(layer):
    if id(sub) in fused:
      continue
    if split_hub_attention.family_of(sub) is not None:
      pairs = split_hub_attention.fuse(sub, axes, devices, named)
      fused.update(id(dense) for dense, _ in pairs)
      out.extend(pairs)
      continue
    how = _splitter(sub)
    weight = layer_state.variable(sub, how[0]) if how else None
    path = named.get(id(weight)) if weight is not None else None
    if path in axes:
      layer_state.refuse_split(sub, path)
      out.append((sub, how[1](sub, path, axes[path], devices)))
  for sub, split in out:  # Shards are new variables: frozen as the layer.
    split.trainable = layer_state.trainable_of(sub)
  return out


def split_layers(layer: keras.layers.Layer, axes: Mapping[str, int],
                 devices: Sequence[str], paths: Sequence[str]) -> Any:
  """`layer` with its sublayers whose weights `axes` names split over
  `devices` (in place), or the split copy of `layer` itself.

  Args:
    layer: a fresh copy of a model layer (variables of its own).
    axes: `{variable path: axis}` (`split_axes`, `path_rules`), paths of
      the original layer's weights.
    devices: the `T` devices.
    paths: the original layer's weight paths, in `layer.weights` order
      (a copy's own paths may differ).

  Returns:
    The layer to call: `layer` (changed in place), a `SplitKernelDense` or
    a `VocabParallelEmbedding`.

  Raises:
    ValueError: a weight `axes` names cannot be split (named by its path).
  """
  named = {id(w): p for w, p in zip(layer.weights, paths)}
  wanted = [p for p in paths if p in axes]
  if not wanted:
    return layer
  original = list(layer.weights)
  splits = _splits(layer, axes, devices, named)
  done = {named[id(w)] for sub, _ in splits for w in sub.weights}
  for path in wanted:
    if path not in done:
      holder = next(s for s in reversed(_compat.flatten_layers(layer))
                    if any(id(w) == id(v) for w in s.weights
                           for v in original if named[id(v)] == path))
      raise _refuse(path, holder, "only Dense and EinsumDense kernels and "
                    "embedding tables split (biases and normalisation stay "
                    "whole)")
  if splits and splits[0][0] is layer:
    return splits[0][1]
  for sub, split in splits:
    _compat.replace_sublayer(layer, sub, split)
  _present_unsplit(layer, original, splits)
  return layer


def _present_unsplit(layer: keras.layers.Layer, original: list[Any],
                     splits: list[tuple[keras.layers.Layer, Any]]) -> None:
  """Makes `layer.get_weights` / `set_weights` give and take its weights as
  before the split (same order; a split weight whole)."""
  slots = []
  for v in original:
    slot = ("var", v, None)
    for sub, split in splits:
      index = [i for i, w in enumerate(sub.weights) if w is v]
      if index:
        slot = ("split", split, index[0])
    slots.append(slot)

  def get_weights():
    return [keras.ops.convert_to_numpy(v) if kind == "var"
            else v.get_weights()[i] for kind, v, i in slots]

  def set_weights(values):
    pending: dict[int, list[Any]] = {}
    for (kind, v, i), value in zip(slots, values):
      if kind == "var":
        v.assign(value)
      else:
        pending.setdefault(id(v), [v, v.get_weights()])[1][i] = value
    for split, weights in pending.values():
      split.set_weights(weights)

  object.__setattr__(layer, "get_weights", get_weights)
  object.__setattr__(layer, "set_weights", set_weights)


def transform(axes: Mapping[str, int],
              devices_of: Callable[[str], Sequence[str]]
              ) -> tensor.Transform:
  """The `tensor.tensor_parallel(transform=...)` that splits, in each copied
  layer, the kernels `axes` names over `devices_of(node name)`; a layer
  called twice keeps the first call's split."""
  done: dict[int, Any] = {}

  def apply(name: str, layer: keras.layers.Layer, copy: keras.layers.Layer,
            args: Any, kwargs: Any) -> keras.layers.Layer:
    if not isinstance(copy, keras.layers.Layer):
      return copy  # A bare op (keras.ops.multiply): no weights.
    if id(copy) not in done:
      if not copy.built:  # Its weights made as the model's layer's were.
        copy(*args, **kwargs)
      cloning.settle(layer, copy)  # Frozen and LoRA'd as the layer.
      paths = [w.path for w in layer.weights]
      done[id(copy)] = split_layers(copy, axes, devices_of(name), paths)
    return done[id(copy)]

  return apply


def split_stages(placed: Any, model: keras.Model, axes: Mapping[str, int],
                 grid: Sequence[Sequence[str]]) -> Any:
  """Splits, in place, the kernels `axes` names inside the layers of a
  staged or pipelined model's stages: stage `k`'s over `grid[k]`.

  Args:
    placed: a `StagedModel` or `PipelinedModel` of `model`.
    model: the unsplit model (its variable paths are the ones `axes` names).
    axes: `{variable path: axis}`.
    grid: each stage's `T` devices.

  Returns:
    `placed`.

  Raises:
    ValueError: `axes` names a whole layer of the model (a top-level
      `Dense`): give it as a `rules=` entry instead; or a weight that
      cannot be split (named by its path).
  """
  originals = {}
  for layer in _compat.flatten_layers(model):
    originals.setdefault(layer.name, layer)
  for k, stage in enumerate(placed.stages):
    for layer in stage.layers:
      original = originals.get(layer.name)
      if original is None or not original.weights:
        continue
      paths = [w.path for w in original.weights]
      if split_layers(layer, axes, grid[k], paths) is not layer:
        raise ValueError(
            f"the tensor-parallel layout splits layer {layer.name!r} as a "
            "whole; on stages, give a whole Dense or attention layer as a "
            "rules= entry ({name regex: column|row|heads}) and the layout "
            "map for the weights inside blocks. A vocabulary-parallel "
            "embedding splits without stages only (tensor, data x tensor): "
            "drop it from the layout map here.")
  return placed
