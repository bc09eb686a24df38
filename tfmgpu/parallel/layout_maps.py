"""Tensor parallelism from a Keras `LayoutMap`: weights split by their path.

keras_hub backbones describe their own tensor-parallel split as a
`keras.distribution.LayoutMap` (`LlamaBackbone.get_layout_map(mesh)`):
regexes on variable paths (`transformer_layer_0/self_attention/query/kernel`)
mapped to one mesh axis name (or `None`) per weight axis. Keras executes it
only on JAX; here it splits the layers *inside* a model's blocks on TF:

* `split_axes(model, layout_map)` reads it: `{variable path: axis}`, the
  weight axis laid on the map's model axis (the tensor dimension; the batch
  axis is the data dimension and leaves a weight whole, as data-parallel
  replicas hold it). `path_rules` does the same from `{path regex: axis}`.
* `split_layers(layer, axes, devices)` swaps every `Dense` and `EinsumDense`
  inside `layer` (any depth: a keras_hub block's attention projections and
  MLP) whose kernel is named for a `SplitKernelDense`: shard `t` holds
  `1/T` of the kernel on `devices[t]` and computes its part of the product
  there (forward and backward, `tensor.on_device`); the parts are joined on
  `devices[0]` (concatenated for an output axis, summed for a contracted
  one), then the bias (held once) and the activation. Attention itself,
  rotary embeddings and normalisation run unsplit on `devices[0]`.
* A split block still gives and takes its weights in unsplit form
  (`get_weights` / `set_weights` in the original order), so weights move
  between layouts by layer name as for every tfmgpu placement.

A weight the map names that tfmgpu cannot split (another layer type, an
axis that `T` does not divide) is refused with its path.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import tensor as tensor_lib

MODEL_AXIS = "model"  # keras_hub's default names of the mesh axes.
BATCH_AXIS = "batch"

# `{path regex: axis}` for keras_hub backbones without a layout map (GPT-2,
# BERT): Megatron's split of their attention (heads) and MLP.
HUB_PATH_RULES = {
    r"transformer_layer_\d+/self_attention(_layer)?/(query|key|value)/kernel":
        1,
    r"transformer_layer_\d+/self_attention(_layer)?/attention_output/kernel":
        0,
    r"transformer_layer_\d+/feedforward_intermediate_dense/kernel": 1,
    r"transformer_layer_\d+/feedforward_output_dense/kernel": 0,
}


def split_axes(model: keras.Model, layout_map: Any) -> dict[str, int]:
  """`{variable path: axis}` of `model`'s weights the map splits over its
  model axis (the last axis name of the map's mesh that is not its batch
  axis; keras_hub's `"model"`).

  Raises:
    ValueError: the map lays one weight on the model axis twice.
  """
  mesh = getattr(layout_map, "device_mesh", None)
  names = tuple(getattr(mesh, "axis_names", ()) or (BATCH_AXIS, MODEL_AXIS))
  model_axis = MODEL_AXIS if MODEL_AXIS in names else names[-1]
  found = {}
  for weight in model.weights:
    layout = layout_map[weight.path]
    if layout is None:
      continue
    axes = [i for i, a in enumerate(layout.axes) if a == model_axis]
    if len(axes) > 1:
      raise ValueError(
          f"the layout map lays weight {weight.path!r} {tuple(layout.axes)} "
          f"on its model axis {model_axis!r} twice; tfmgpu splits a weight "
          "along one axis.")
    if axes:
      found[weight.path] = axes[0]
  return found


def path_rules(model: keras.Model, rules: Mapping[str, int]) -> dict[str, int]:
  """`{variable path: axis}` from `{path regex: axis}` (the first regex that
  matches a path, anywhere in it, as a `LayoutMap` matches)."""
  found = {}
  for weight in model.weights:
    for regex, axis in rules.items():
      if re.search(regex, weight.path):
        found[weight.path] = int(axis)
        break
  return found


def _specs(layer: keras.layers.Layer) -> tuple[str, str, str]:
  """`(input, kernel, output)` einsum specs of a Dense or EinsumDense."""
  if isinstance(layer, keras.layers.EinsumDense):
    ins, out = layer.equation.split("->")
    x, k = ins.split(",")
    return x, k, out
  return "...i", "io", "...o"


def _position(spec: str, letter: str) -> int:
  """The axis of `letter` in an einsum operand spec (negative after a
  `...`)."""
  if "..." in spec:
    tail = spec.split("...")[1]
    if letter in tail:
      return tail.index(letter) - len(tail)
  return spec.index(letter)


@keras.saving.register_keras_serializable(package="tfmgpu")
class SplitKernelDense(keras.layers.Layer):
  """A `Dense` or `EinsumDense` with its kernel split along one axis.

  Shard `t` (on `devices[t]`) computes `einsum(x_t, kernel_t)`: for an axis
  of the output, its slice of the output (joined by concatenation); for a
  contracted axis, the product of its slice of `x` (joined by a sum). The
  join, the bias (held once, on `devices[0]`) and the activation run on
  `devices[0]`. `get_weights` gives the original layer's (kernel whole).
  """

  def __init__(self, equation: str, kernel: np.ndarray, axis: int,
               devices: Sequence[str], *, bias: np.ndarray | None = None,
               activation: Any = None, **kwargs):
    super().__init__(**kwargs)
    self.equation, self.axis = equation, int(axis)
    self.devices = tuple(str(d) for d in devices)
    x, k, out = (equation.split("->")[0].split(",")
                 + [equation.split("->")[1]])
    letter = k[self.axis]
    self.gathers = letter in out
    self._join_axis = (_position(out, letter) if self.gathers
                       else _position(x, letter))
    self.activation = keras.activations.get(activation)
    self.kernels = [
        self._weight(self.devices[t], f"kernel_{t}", piece)
        for t, piece in enumerate(np.split(kernel, len(self.devices),
                                           self.axis))]
    self.bias = (None if bias is None else
                 self._weight(self.devices[0], "bias", bias))
    self.built = True

  def _weight(self, device: str, name: str, value: np.ndarray):
    with tf.device(device):
      return self.add_weight(
          name=name, shape=value.shape, trainable=True,
          initializer=lambda shape, dtype=None: tf.constant(value, dtype))

  def _shard(self, t: int, x):
    if not self.gathers:
      size = self.kernels[t].shape[self.axis]
      x = keras.ops.take(x, np.arange(t * size, (t + 1) * size),
                         axis=self._join_axis)
    return keras.ops.einsum(self.equation, x,
                            keras.ops.cast(self.kernels[t], x.dtype))

  def _join(self, *parts):
    y = (keras.ops.concatenate(parts, axis=self._join_axis) if self.gathers
         else keras.ops.sum(keras.ops.stack(parts), axis=0))
    if self.bias is not None:
      y = keras.ops.add(y, keras.ops.cast(self.bias, y.dtype))
    return self.activation(y) if self.activation is not None else y

  def call(self, inputs):
    parts = [tensor_lib.on_device(d, lambda x, t=t: self._shard(t, x), inputs,
                                  name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    return tensor_lib.on_device(self.devices[0], self._join, *parts,
                                name=f"{self.name}_join")

  def compute_output_spec(self, inputs):
    kernel = np.zeros([sum(k.shape[i] for k in self.kernels)
                       if i == self.axis else d
                       for i, d in enumerate(self.kernels[0].shape)])
    return keras.KerasTensor(
        keras.ops.einsum(self.equation, np.zeros(
            [1 if d is None else d for d in inputs.shape]), kernel).shape,
        self.compute_dtype)

  def get_weights(self) -> list[np.ndarray]:
    kernel = np.concatenate([keras.ops.convert_to_numpy(k)
                             for k in self.kernels], axis=self.axis)
    return [kernel] + ([] if self.bias is None
                       else [keras.ops.convert_to_numpy(self.bias)])

  def set_weights(self, weights: Sequence[Any]) -> None:
    pieces = np.split(np.asarray(weights[0]), len(self.kernels), self.axis)
    for v, piece in zip(self.kernels, pieces):
      v.assign(piece)
    if self.bias is not None:
      self.bias.assign(weights[1])


def _refuse(path: str, layer: keras.layers.Layer, why: str) -> ValueError:
  return ValueError(
      f"the tensor-parallel layout names weight {path!r} (layer "
      f"{layer.name!r}, {type(layer).__name__}) but tfmgpu cannot split it: "
      f"{why}. Drop it from the layout map (or rules), or use a tensor size "
      "that divides it.")


def _split_one(layer: keras.layers.Layer, path: str, axis: int,
               devices: Sequence[str]) -> SplitKernelDense:
  """The split copy of one Dense / EinsumDense (its kernel at `path`)."""
  shape = tuple(layer.kernel.shape)
  if shape[axis] % len(devices):
    raise _refuse(path, layer, f"its axis {axis} of size {shape[axis]} is "
                  f"not divisible by T={len(devices)}")
  x, k, out = _specs(layer)
  bias = getattr(layer, "bias", None)
  return SplitKernelDense(
      f"{x},{k}->{out}", keras.ops.convert_to_numpy(layer.kernel), axis,
      devices, activation=keras.activations.serialize(layer.activation),
      bias=None if bias is None else keras.ops.convert_to_numpy(bias),
      name=layer.name, dtype=layer.dtype_policy)


def split_layers(layer: keras.layers.Layer, axes: Mapping[str, int],
                 devices: Sequence[str], paths: Sequence[str]) -> Any:
  """`layer` with its sublayers whose kernels `axes` names split over
  `devices` (in place), or the split copy of `layer` itself.

  Args:
    layer: a fresh copy of a model layer (variables of its own).
    axes: `{variable path: axis}` (`split_axes`, `path_rules`), paths of
      the original layer's weights.
    devices: the `T` devices.
    paths: the original layer's weight paths, in `layer.weights` order
      (a copy's own paths may differ).

  Returns:
    The layer to call: `layer` (changed in place) or a `SplitKernelDense`.

  Raises:
    ValueError: a weight `axes` names cannot be split (named by its path).
  """
  named = {id(w): p for w, p in zip(layer.weights, paths)}
  wanted = [p for p in paths if p in axes]
  if not wanted:
    return layer
  original = list(layer.weights)
  splits = []
  for sub in _compat.flatten_layers(layer):
    kernel = getattr(sub, "kernel", None)
    path = named.get(id(kernel)) if kernel is not None else None
    if path in axes and type(sub) in (keras.layers.Dense,  # pylint: disable=unidiomatic-typecheck
                                      keras.layers.EinsumDense):
      splits.append((sub, _split_one(sub, path, axes[path], devices)))
  done = {named[id(sub.kernel)] for sub, _ in splits}
  for path in wanted:
    if path not in done:
      holder = next(s for s in reversed(_compat.flatten_layers(layer))
                    if any(id(w) == id(v) for w in s.weights
                           for v in original if named[id(v)] == path))
      raise _refuse(path, holder, "only Dense and EinsumDense kernels split "
                    "(embeddings, biases and normalisation stay whole)")
  if splits and splits[0][0] is layer:
    return splits[0][1]
  for sub, split in splits:
    _compat.replace_sublayer(layer, sub, split)
  _present_unsplit(layer, original, dict((id(s), n) for s, n in splits),
                   [s for s, _ in splits])
  return layer


def _present_unsplit(layer: keras.layers.Layer, original: list[Any],
                     split_of: dict[int, SplitKernelDense],
                     replaced: list[keras.layers.Layer]) -> None:
  """Makes `layer.get_weights` / `set_weights` give and take its weights as
  before the split (same order; a split kernel whole)."""
  slots = []
  for v in original:
    slot = ("var", v, None)
    for sub in replaced:
      bias = getattr(sub, "bias", None)
      if v is sub.kernel:
        slot = ("split", split_of[id(sub)], 0)
      elif bias is not None and v is bias:
        slot = ("split", split_of[id(sub)], 1)
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
              ) -> tensor_lib.Transform:
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
            "whole; on stages, give a whole layer as a rules= entry "
            "({name regex: column|row|heads}) and the layout map for the "
            "weights inside blocks.")
  return placed


def _splittable(model: keras.Model, axes: Mapping[str, int]
                ) -> dict[str, int]:
  """The entries of `axes` that name a Dense or EinsumDense kernel."""
  kernels = {l.kernel.path for l in _compat.flatten_layers(model)
             if type(l) in (keras.layers.Dense, keras.layers.EinsumDense)  # pylint: disable=unidiomatic-typecheck
             and getattr(l, "kernel", None) is not None}
  return {p: a for p, a in axes.items() if p in kernels}


def own_axes(model: keras.Model, tensor: int) -> dict[str, int] | None:
  """`{variable path: axis}` of a keras_hub model's own split: its
  backbone's `get_layout_map` (the weights tfmgpu splits: attention and MLP
  kernels; embeddings stay whole), else `HUB_PATH_RULES` for a keras_hub
  backbone without one; `None` for other models."""
  for layer in _compat.flatten_layers(model):
    module = type(layer).__module__
    if not module.startswith("keras_hub") or not isinstance(layer,
                                                            keras.Model):
      continue
    get = getattr(type(layer), "get_layout_map", None)
    if get is None or not hasattr(layer, "token_embedding"):
      continue
    try:
      mesh = keras.distribution.DeviceMesh(
          (1, tensor), [BATCH_AXIS, MODEL_AXIS], [f"cpu:{i}"
                                                  for i in range(tensor)])
      return _splittable(model, split_axes(model, get(mesh)))
    except (NotImplementedError, TypeError, ValueError):
      break  # The base class's: no map of its own.
  if any(type(l).__module__.startswith("keras_hub")
         for l in _compat.flatten_layers(model)):
    return path_rules(model, HUB_PATH_RULES)
  return None
