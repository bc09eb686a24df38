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
* `own_axes(model, T)`: a keras_hub model's own split (its backbone's
  `get_layout_map`, else `HUB_PATH_RULES`), keeping whole what tfmgpu does
  not split by path.

`split_blocks` then splits the kernels these name inside the model's
blocks; a weight named that cannot be split is refused there with its path.

`warn_if_keras_distribution`: a global Keras distribution
(`keras.distribution.set_distribution`) is ignored by Keras on TF, and by
tfmgpu: said where a user would expect it to apply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from absl import logging
import keras
import numpy as np

from tfmgpu import _compat
from tfmgpu.parallel import layer_state

def warn_if_keras_distribution(what: str) -> None:
  """Logs a warning when a global Keras distribution is set: Keras lays
  out variables by it on JAX only, so on TensorFlow it is ignored (by
  Keras' `fit` and by tfmgpu, `what`), silently."""
  found = keras.distribution.distribution()
  if found is None:
    return
  logging.warning(
      "A Keras distribution is set (%s, by keras.distribution."
      "set_distribution): Keras ignores it on the TensorFlow backend, and "
      "%s does not read it. For tensor parallelism from a LayoutMap use "
      "tfmgpu.parallel.build_layout(model, Layout(tensor=T), "
      "layout_map=...); for data parallelism a strategy, e.g. "
      "Trainer(model, strategy='mirrored') with the model built in its "
      "scope.", type(found).__name__, what)


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


def path_rules(model: keras.Model, rules: Mapping[str, int | None]
               ) -> dict[str, int]:
  """`{variable path: axis}` from `{path regex: axis}` (the first regex that
  matches a path, anywhere in it, as a `LayoutMap` matches; a negative
  axis counts from the last, `None` keeps the weights it matches whole).

  Raises:
    ValueError: an axis the weight it matches does not have.
  """
  found = {}
  for weight in model.weights:
    for regex, axis in rules.items():
      if re.search(regex, weight.path):
        if axis is None:
          break  # Kept whole.
        rank = len(weight.shape)
        if not -rank <= int(axis) < rank:
          raise ValueError(
              f"layout_map entry {regex!r}: {axis!r} matches weight "
              f"{weight.path!r} of shape {tuple(weight.shape)}, which has "
              f"no axis {axis}. Give an axis from 0 to {rank - 1} (or "
              "None to keep it whole).")
        found[weight.path] = int(axis) % rank
        break
  return found


def _splittable(model: keras.Model, axes: Mapping[str, int]
                ) -> dict[str, int]:
  """The entries of `axes` that name a Dense or EinsumDense kernel."""
  kernels = {layer_state.variable(l, "kernel").path
             for l in _compat.flatten_layers(model)
             if type(l) in (keras.layers.Dense, keras.layers.EinsumDense)  # pylint: disable=unidiomatic-typecheck
             and l.built}
  return {p: a for p, a in axes.items() if p in kernels}


def left_whole(model: keras.Model, axes: Mapping[str, int]
               ) -> tuple[list[str], float]:
  """`(paths, fraction)`: the Dense / EinsumDense kernels of `model` that
  `axes` does not split (they stay whole on one device), and their share of
  all its weights' elements."""
  kernels = {}
  for l in _compat.flatten_layers(model):
    if type(l) in (keras.layers.Dense, keras.layers.EinsumDense) and l.built:  # pylint: disable=unidiomatic-typecheck
      kernel = layer_state.variable(l, "kernel")
      kernels[kernel.path] = int(np.prod(kernel.shape))
  whole = sorted(p for p in kernels if p not in axes)
  total = sum(int(np.prod(w.shape)) for w in model.weights) or 1
  return whole, sum(kernels[p] for p in whole) / total


def nothing_to_split(model: keras.Model, tensor: int) -> ValueError:
  """The error for a keras_hub model whose own split (`own_axes`) is empty:
  no layout map of its own, no path matching `HUB_PATH_RULES`."""
  return ValueError(
      f"tensor={tensor} finds nothing to split in model {model.name!r}: "
      "its keras_hub backbone has no layout map of its own, and no weight "
      "path matches tfmgpu's keras_hub path rules ("
      f"{', '.join(HUB_PATH_RULES)}). Pass layout_map={{path regex: axis}} "
      "naming its attention and MLP kernels (their paths: [w.path for w in "
      "model.weights]), or use tensor=1.")


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
