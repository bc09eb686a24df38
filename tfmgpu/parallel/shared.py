"""Weights used by several layers: found, and kept one weight in every copy.

A tied embedding is one variable that two layers read: keras_hub's CausalLM
heads call the backbone's `token_embedding` in reverse, and a custom head
may hold the embedding layer itself. Keras' own copies (`from_config`,
`keras.models.clone_model`) and tfmgpu's stage cuts rebuild each layer with
fresh variables, so such a variable becomes two that train apart: a silently
wrong model. Here a shared variable is named by its *sites*: the top-level
layers that hold it and its position in each one's `weights`.

* `find_shared(layers)` lists the variables more than one layer holds.
* `tie(layers, weights, what)` makes a set of copies of those layers share
  again: at every site after the first, the copy's variable is swapped for
  the first site's (its owner), inside the layer that holds it, so a call
  reads the owner's variable (across devices, if the copies live apart) and
  a tape differentiates it. A placed model then sums the gradients of every
  use (`sum_by_variable`).
* `between_stages` / `across_stages` say which shared weights a stage plan
  puts on more than one stage (`StagePlan.shared`, printed in its table).

Sites that cannot be made one variable (another shape, a missing layer) are
refused with the weight's path, never left apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import placed
from tfmgpu.parallel import plan as plan_lib

Site = tuple[str, int]  # (top-level layer name, index in its `weights`)


@dataclasses.dataclass(frozen=True)
class SharedWeight:
  """One variable held by several top-level layers.

  Attributes:
    path: the variable's Keras path (`token_embedding/embeddings`).
    sites: `(layer name, index in layer.weights)` of each holder, the
      owner (the first in the order given to `find_shared`) first.
    bytes: the variable's size in bytes.
  """
  path: str
  sites: tuple[Site, ...]
  bytes: int = 0

  @property
  def layers(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.sites)


def find_shared(layers: Iterable[keras.layers.Layer]
                | Mapping[str, keras.layers.Layer]
                ) -> tuple[SharedWeight, ...]:
  """The variables that more than one of `layers` holds, in first-use order.

  Args:
    layers: top-level layers with unique names (a model's layers), or
      `{name: layer}` (a model graph's `ModelGraph.layers()` in topological
      order, where a layer called twice is a site under each call's name):
      the first holder owns.
  """
  sites: dict[int, list[Site]] = {}
  found: dict[int, Any] = {}
  named = (layers.items() if isinstance(layers, Mapping)
           else ((layer.name, layer) for layer in layers))
  for name, layer in named:
    for i, weight in enumerate(layer.weights):
      sites.setdefault(id(weight), []).append((name, i))
      found.setdefault(id(weight), weight)
  size = lambda w: math.prod(w.shape) * graph_lib.dtype_size(w.dtype)
  return tuple(SharedWeight(found[k].path, tuple(s), size(found[k]))
               for k, s in sites.items()
               if len({name for name, _ in s}) > 1)


def across_stages(weights: Sequence[SharedWeight],
                  stage_of: Mapping[str, int]
                  ) -> tuple[plan_lib.SharedStages, ...]:
  """The shared weights whose holders are on more than one stage.

  Args:
    weights: from `find_shared`.
    stage_of: `{layer name: stage index}`.
  """
  out = []
  for w in weights:
    stages = tuple(dict.fromkeys(stage_of[name] for name in w.layers))
    if len(stages) > 1:
      out.append(plan_lib.SharedStages(w.path, w.layers, stages, w.bytes))
  return tuple(out)


def between_stages(graph: graph_lib.ModelGraph,
                   stages: Iterable[plan_lib.Stage]
                   ) -> tuple[plan_lib.SharedStages, ...]:
  """The weights that the layers of a model graph share between `stages`
  (a plan's), for `StagePlan.shared`."""
  stage_of = {name: s.index for s in stages for name in s.layers}
  return across_stages(find_shared(graph.layers()), stage_of)


def _replace_variable(layer: keras.layers.Layer, old: Any, new: Any) -> None:
  """Makes `layer` (and its sub-layers) hold `new` wherever it held `old`.

  Keras tracks a variable in the store of the layer that made it and in the
  attribute it was assigned to; both are swapped (through `setattr`, so the
  TF checkpoint dependency follows).

  Raises:
    ValueError: `old` is still among `layer.weights` (held somewhere this
      cannot reach, such as a list attribute).
  """
  for sub in _compat.flatten_layers(layer):
    _compat.replace_tracked_variable(sub, old, new)
  if any(w is old for w in layer.weights):
    raise ValueError(
        f"cannot make layer {layer.name!r} use the shared weight "
        f"{new.path!r}: it holds its copy where tfmgpu cannot swap it. Give "
        "the layer the variable as a plain attribute.")


def tie(layers: Mapping[str, keras.layers.Layer],
        weights: Sequence[SharedWeight], what: str) -> None:
  """Makes copies of shared weights one variable again, in place.

  Args:
    layers: `{name: layer}`, copies of the layers `weights` were found in
      (same names, same weights in the same order).
    weights: from `find_shared` on the originals.
    what: the copies, for errors (`"stage model"`, `"serving clone"`).

  Raises:
    ValueError: a site's layer is missing, has fewer weights, or its weight
      has another shape than the owner's; the message names the weight.
  """
  needed = {name for w in weights for name in w.layers}
  held = {name: list(layer.weights) for name, layer in layers.items()
          if name in needed}
  for weight in weights:
    found = []
    for name, index in weight.sites:
      if name not in held or index >= len(held[name]):
        raise ValueError(
            f"the shared weight {weight.path!r} (held by layers "
            f"{list(weight.layers)}) has no copy in layer {name!r} of the "
            f"{what}; the copy is not the same architecture.")
      found.append(held[name][index])
    owner = found[0]
    for (name, _), copy in zip(weight.sites[1:], found[1:]):
      if copy is owner:
        continue
      if tuple(copy.shape) != tuple(owner.shape):
        raise ValueError(
            f"the shared weight {weight.path!r} is {tuple(owner.shape)} in "
            f"layer {weight.sites[0][0]!r} but {tuple(copy.shape)} in layer "
            f"{name!r} of the {what}: the copies cannot be one weight. Split "
            "or rebuild both layers alike.")
      _replace_variable(layers[name], copy, owner)


def sum_by_variable(pairs: Iterable[tuple[Any, Any]]) -> dict[int, Any]:
  """`{id(variable): gradient}` from `(variable, gradient)` pairs; a variable
  met several times (a shared weight used on several stages) gets the sum of
  its gradients, added on the variable's device."""
  variables, grads = {}, {}
  for v, g in pairs:
    variables[id(v)] = v
    grads.setdefault(id(v), []).append(g)
  out = {}
  for key, parts in grads.items():
    if len(parts) == 1:
      out[key] = parts[0]
      continue
    with tf.device(placed.variable_device(variables[key])), \
        tf.name_scope("shared_weight_sum"):
      out[key] = microbatch.sum_gradients(parts)
  return out
