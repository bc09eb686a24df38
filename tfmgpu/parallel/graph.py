"""The layer graph of a Keras model: topological order and where it can be cut.

A model can be split where exactly one tensor crosses from the layers before
to the layers after (a *cut point*). A Sequential model can be cut between any
two layers; a functional model with residual connections can only be cut
between its blocks. `ModelGraph` lists a model's layer calls in topological
order and, for any position, the tensors that cross a cut placed there.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Sequence

import keras
import tensorflow as tf


def dtype_size(dtype: Any) -> int:
  """Bytes of one element of a Keras or TF dtype."""
  return tf.as_dtype(keras.backend.standardize_dtype(dtype)).size


def elements(shape: Sequence[int | None]) -> int:
  """Number of elements per example (batch axis dropped; unknown dims = 1)."""
  return math.prod(1 if d is None else int(d) for d in tuple(shape)[1:])


def tensor_bytes(tensor: keras.KerasTensor) -> int:
  """Bytes of one example of a symbolic tensor."""
  return elements(tensor.shape) * dtype_size(tensor.dtype)


def _producer(tensor: keras.KerasTensor):
  # Keras 3 has no public graph-walking API; `_keras_history` and
  # `_inbound_nodes` are what `keras.Model` itself uses to walk its graph.
  op, node_index, _ = tensor._keras_history  # pylint: disable=protected-access
  return op._inbound_nodes[node_index]  # pylint: disable=protected-access


def _single_input_output(model: keras.Model):
  """`(input, output)` of a built single-input, single-output model."""
  if not isinstance(model, keras.Model):
    raise TypeError(f"model={model!r} is not a keras.Model.")
  if not model.built:
    raise ValueError(
        f"model {model.name!r} is not built. Build it first (give it a "
        "keras.Input, or call model.build(input_shape)) so its layer "
        "shapes are known.")
  try:
    inputs, outputs = model.inputs, model.outputs
  except (AttributeError, ValueError) as e:
    raise ValueError(
        f"model {model.name!r} has no symbolic inputs/outputs "
        f"({type(model).__name__}): only Sequential and functional models "
        "can be split. Rewrite it functionally.") from e
  if inputs is None or len(inputs) != 1 or len(outputs) != 1:
    raise ValueError(
        f"model {model.name!r} has {len(inputs or [])} inputs and "
        f"{len(outputs)} outputs; only single-input, single-output chains "
        "can be split into stages.")
  return inputs[0], outputs[0]


def _reachable_nodes(model: keras.Model, model_input, model_output
                     ) -> dict[int, Any]:
  """`{id: node}` of the layer calls reachable backwards from the output.

  Raises:
    ValueError: a layer is called more than once.
  """
  found, stack = {}, [model_output]
  while stack:
    node = _producer(stack.pop())
    if id(node) in found or node.operation is model_input._keras_history[0]:  # pylint: disable=protected-access
      continue
    found[id(node)] = node
    stack.extend(node.input_tensors)
  counts: dict[str, int] = {}
  for node in found.values():
    counts[node.operation.name] = counts.get(node.operation.name, 0) + 1
  shared = sorted(n for n, c in counts.items() if c > 1)
  if shared:
    raise ValueError(
        f"model {model.name!r} calls layer(s) {shared} more than once; a "
        "shared layer cannot be placed on one stage device. Give each call "
        "its own layer.")
  return found


def _topological_order(model: keras.Model, found: dict[int, Any]) -> list[Any]:
  """Kahn's algorithm, ties broken by the model's own layer order."""
  # Functional models list bare ops (keras.ops.*) in `_operations` only.
  known = getattr(model, "_operations", None) or model.layers
  order = {id(l): i for i, l in enumerate(known)}
  producers = {id(t): k for k, n in found.items() for t in n.output_tensors}
  users: dict[int, list[int]] = {k: [] for k in found}
  missing = {}
  for k, n in found.items():
    deps = {producers[id(t)] for t in n.input_tensors if id(t) in producers}
    missing[k] = len(deps)
    for d in deps:
      users[d].append(k)
  rank = lambda k: (order.get(id(found[k].operation), len(order)),
                    found[k].operation.name)
  ready = [(rank(k), k) for k, m in missing.items() if m == 0]
  heapq.heapify(ready)
  nodes = []
  while ready:
    _, k = heapq.heappop(ready)
    nodes.append(found[k])
    for u in users[k]:
      missing[u] -= 1
      if missing[u] == 0:
        heapq.heappush(ready, (rank(u), u))
  return nodes


class ModelGraph:
  """The nodes of a single-input, single-output Keras model in topological order.

  Attributes:
    model: the model.
    input: its symbolic input tensor.
    output: its symbolic output tensor.
    nodes: the layer calls (Keras `Node`s) in topological order, inputs
      excluded.
    names: the layer name of each node.
  """

  def __init__(self, model: keras.Model):
    """Walks `model`'s graph.

    Raises:
      TypeError: `model` is not a Keras model.
      ValueError: the model is not built, is subclassed, has several inputs
        or outputs, or calls a layer more than once.
    """
    self.input, self.output = _single_input_output(model)
    self.model = model
    found = _reachable_nodes(model, self.input, self.output)
    self.nodes = _topological_order(model, found)
    self.names = [n.operation.name for n in self.nodes]
    self._position = {name: i for i, name in enumerate(self.names)}
    # Each tensor lives from its producer's position to its last consumer's.
    self._tensors = {id(self.input): [self.input, -1, -1]}
    for i, node in enumerate(self.nodes):
      for t in node.output_tensors:
        self._tensors[id(t)] = [t, i, i]
    for i, node in enumerate(self.nodes):
      for t in node.input_tensors:
        self._tensors[id(t)][2] = max(self._tensors[id(t)][2], i)
    self._tensors[id(self.output)][2] = len(self.nodes)

  def tensors(self) -> list[keras.KerasTensor]:
    """Every tensor of the graph: the input and each layer output."""
    return [t for t, _, _ in self._tensors.values()]

  def position(self, layer_name: str) -> int:
    """Topological position of a layer; raises KeyError for unknown names."""
    if layer_name not in self._position:
      raise KeyError(layer_name)
    return self._position[layer_name]

  def crossing(self, position: int) -> list[keras.KerasTensor]:
    """The tensors that cross a cut placed just before node `position`."""
    return [t for t, first, last in self._tensors.values()
            if first < position <= last]

  def cut_positions(self) -> list[int]:
    """Positions (1..n-1) where exactly one tensor crosses."""
    return [i for i in range(1, len(self.nodes)) if len(self.crossing(i)) == 1]

  def boundary(self, position: int) -> keras.KerasTensor:
    """The single tensor crossing a valid cut (0: the input, n: the output)."""
    if position == 0:
      return self.input
    if position == len(self.nodes):
      return self.output
    (tensor,) = self.crossing(position)
    return tensor

  def describe(self, tensor: keras.KerasTensor) -> str:
    """`"output of '<layer>' (<shape>)"`, for error messages."""
    op = tensor._keras_history[0]  # pylint: disable=protected-access
    return f"output of {op.name!r} {tuple(tensor.shape)}"
