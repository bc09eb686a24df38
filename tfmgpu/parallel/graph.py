"""The layer graph of a Keras model: topological order and what crosses a cut.

A functional (or Sequential) model can be cut before any of its layer calls:
the layers before the cut form one stage, the layers after it the next, and
every tensor made before the cut and read after it *crosses* it: the
activation, skip (residual) tensors, and model inputs that later layers read
(a padding mask, position ids, a tabular input joined late). `ModelGraph`
lists a model's layer calls in topological order and, for any position, the
tensors that cross a cut placed there and their bytes. `shapes_only` builds
a model to plan (its layers and weight shapes, no weight values).
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Mapping, Sequence

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


def shapes_only(build: Callable[[], keras.Model]) -> keras.Model:
  """Calls `build()` so that its weights get shapes but no values.

  A plan needs only the layer graph and the weight shapes: `gpt2_xl` builds
  so in a second instead of allocating 6 GB. Its weights stay without values
  for good (Keras would otherwise fill them in at the next model built in
  this process), so the model is for planning only: `ModelGraph`,
  `plan_stages`, the costs; never call or train it.
  """
  # Keras 3 defers a variable made in a stateless scope and records it in a
  # global list, which the next top-level stateless scope initialises.
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  key = "uninitialized_variables"
  before = list(global_state.get_global_attribute(key, [],
                                                  set_to_default=True))
  try:
    with keras.StatelessScope(initialize_variables=False):
      return build()
  finally:
    global_state.set_global_attribute(key, before)


def output_names(model: keras.Model) -> tuple[str, ...]:
  """The names that key a model's outputs in a loss or metric dict.

  The dict's keys for a model returning a dict (a keras_hub `BertBackbone`
  returns `{"sequence_output": ..., "pooled_output": ...}`; Keras'
  `output_names` would name the layers that make them instead), the output
  layers' names for a list, and `()` for a single output.
  """
  flat = tf.nest.flatten(model.outputs)
  if len(flat) < 2:
    return ()
  try:
    output = model.output
  except (AttributeError, ValueError):  # Sequential before its first call.
    output = None
  if isinstance(output, Mapping):
    return tuple(output)
  return tuple(model.output_names)


def _producer(tensor: keras.KerasTensor):
  # Keras 3 has no public graph-walking API; `_keras_history` and
  # `_inbound_nodes` are what `keras.Model` itself uses to walk its graph.
  op, node_index, _ = tensor._keras_history  # pylint: disable=protected-access
  return op._inbound_nodes[node_index]  # pylint: disable=protected-access


def _symbolic_inputs_outputs(model: keras.Model):
  """`(inputs, outputs)`: the flat symbolic tensors of a built model."""
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
  if not inputs or not outputs:
    raise ValueError(
        f"model {model.name!r} has {len(inputs or [])} inputs and "
        f"{len(outputs or [])} outputs; a model to split needs symbolic "
        "inputs and outputs (a functional or Sequential model).")
  return list(inputs), list(outputs)


def _reachable_nodes(model: keras.Model, model_inputs, model_outputs
                     ) -> dict[int, Any]:
  """`{id: node}` of the layer calls reachable backwards from the outputs.

  Raises:
    ValueError: a layer is called more than once.
  """
  input_ops = {id(t._keras_history[0]) for t in model_inputs}  # pylint: disable=protected-access
  found, stack = {}, list(model_outputs)
  while stack:
    node = _producer(stack.pop())
    if id(node) in found or id(node.operation) in input_ops:
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


def config_sequence_length(model: keras.Model) -> int | None:
  """The `max_sequence_length` a model (or a model nested in it, such as a
  keras_hub backbone inside its task model) was built with, if any.

  Read as an attribute, not through `get_config`: some layers' configs
  raise (keras_hub 0.32's Llama blocks).
  """
  for layer in [model] + list(getattr(model, "layers", [])):
    value = getattr(layer, "max_sequence_length", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
      return value
  return None


def _has_unknown(shape: Sequence[int | None]) -> bool:
  return any(d is None for d in tuple(shape)[1:])


def _given_shapes(inputs: list[Any], input_shape: Any,
                  length: int | None) -> list[tuple[int | None, ...]]:
  """Each input's shape (batch axis `None`): from `input_shape` (a shape for
  one input, a list by position or a dict by input name), else the
  symbolic one with unknown dimensions set to `length`."""
  if input_shape is None:
    given = [None] * len(inputs)
  elif isinstance(input_shape, dict):
    names = [t._keras_history[0].name for t in inputs]  # pylint: disable=protected-access
    given = [input_shape.get(n) for n in names]
  elif all(isinstance(d, (int, type(None))) for d in input_shape):
    given = [input_shape] if len(inputs) == 1 else [None] * len(inputs)
  else:
    given = list(input_shape)
  shapes = []
  for t, g in zip(inputs, given):
    shape = tuple(t.shape) if g is None else (None,) + tuple(g)
    if len(shape) != len(t.shape):
      raise ValueError(
          f"input_shape={input_shape!r} gives input {t.name!r} the shape "
          f"{shape[1:]}, but the model takes {tuple(t.shape)[1:]}; give "
          "one example's shape per input (no batch axis).")
    shapes.append((None,) + tuple(length if d is None else d
                                  for d in shape[1:]))
  return shapes


def _resolved_shapes(nodes: list[Any], inputs: list[Any],
                     shapes: list[tuple[int | None, ...]]
                     ) -> dict[int, tuple[int | None, ...]]:
  """`{id(tensor): shape}` with the inputs' `shapes` carried through each
  layer's `compute_output_spec`; a layer that cannot say keeps the
  symbolic shapes of its outputs (and their unknown dimensions)."""
  specs = {id(t): keras.KerasTensor(shape, dtype=t.dtype)
           for t, shape in zip(inputs, shapes)}
  for node in nodes:
    try:
      args, kwargs = node.arguments.fill_in(specs)
      out = tf.nest.flatten(node.operation.compute_output_spec(*args,
                                                               **kwargs))
    except Exception:  # pylint: disable=broad-except
      out = []  # Any layer's own error: keep its symbolic output shapes.
    if len(out) != len(node.output_tensors):
      out = node.output_tensors
    for old, new in zip(node.output_tensors, out):
      specs[id(old)] = new
  return {k: tuple(v.shape) for k, v in specs.items()}


def _structure(model: keras.Model, which: str, flat: list[Any]) -> Any:
  """`model.input` or `model.output` (the structure the model takes or
  returns); a single tensor when there is one (Sequential models have no
  `input` before their first call)."""
  if len(flat) == 1:
    return flat[0]
  return getattr(model, which)


class ModelGraph:
  """The layer calls of a Keras model in topological order, and its cuts.

  A cut at position `p` (`0 < p < len(nodes)`) puts `nodes[:p]` before it
  and `nodes[p:]` after it. Position 0 is the model's input, position
  `len(nodes)` its output.

  Attributes:
    model: the model.
    inputs: its symbolic input tensors, flat (`model.inputs`).
    outputs: its symbolic output tensors, flat (`model.outputs`).
    input_structure: its inputs as the model takes them (one tensor, or a
      list or dict of them: `model.input`).
    output_structure: its outputs as the model returns them (`model.output`).
    nodes: the layer calls (Keras `Node`s) in topological order, inputs
      excluded.
    names: the layer name of each node.
  """

  def __init__(self, model: keras.Model, input_shape: Any = None):
    """Walks `model`'s graph.

    Args:
      model: the model.
      input_shape: one example's shape per input (no batch axis; a shape,
        a list by position or a dict by input name), for a model whose
        inputs leave a length unknown (`keras.Input((None,))`): the shapes
        of the data it will train on. Defaults to the model's own input
        shapes, with an unknown length set to its `max_sequence_length`
        (`config_sequence_length`) when it has one.

    Raises:
      TypeError: `model` is not a Keras model.
      ValueError: the model is not built, is subclassed, or calls a layer
        more than once; or `input_shape` does not fit the inputs.
    """
    self.inputs, self.outputs = _symbolic_inputs_outputs(model)
    self.input_structure = _structure(model, "input", self.inputs)
    self.output_structure = _structure(model, "output", self.outputs)
    self.model = model
    found = _reachable_nodes(model, self.inputs, self.outputs)
    self.nodes = _topological_order(model, found)
    self.names = [n.operation.name for n in self.nodes]
    self._shapes: dict[int, tuple[int | None, ...]] = {}
    if input_shape is not None or any(
        _has_unknown(t.shape) for n in self.nodes for t in n.output_tensors):
      given = _given_shapes(self.inputs, input_shape,
                            config_sequence_length(model))
      self._shapes = _resolved_shapes(self.nodes, self.inputs, given)
    self._position = {name: i for i, name in enumerate(self.names)}
    # Each tensor lives from its producer's position to its last consumer's
    # (model inputs from -1, model outputs to len(nodes)).
    self._tensors = {id(t): [t, -1, -1] for t in self.inputs}
    for i, node in enumerate(self.nodes):
      for t in node.output_tensors:
        self._tensors.setdefault(id(t), [t, i, i])
    for i, node in enumerate(self.nodes):
      for t in node.input_tensors:
        if id(t) in self._tensors:
          self._tensors[id(t)][2] = max(self._tensors[id(t)][2], i)
    for t in self.outputs:
      self._tensors[id(t)][2] = len(self.nodes)

  def shape(self, tensor: keras.KerasTensor) -> tuple[int | None, ...]:
    """A tensor's shape with the lengths the data or the model's config
    give (`input_shape`); `None` where they stay unknown."""
    return self._shapes.get(id(tensor), tuple(tensor.shape))

  def tensor_bytes(self, tensor: keras.KerasTensor) -> int:
    """Bytes of one example of a tensor of the graph (`shape`; a length
    still unknown counts as 1: see `unknown`)."""
    return elements(self.shape(tensor)) * dtype_size(tensor.dtype)

  def unknown(self) -> list[keras.KerasTensor]:
    """The tensors whose shape still has an unknown dimension (a sequence
    length neither the data nor the model's config gave)."""
    return [t for t in self.tensors() if _has_unknown(self.shape(t))]

  def tensors(self) -> list[keras.KerasTensor]:
    """Every tensor of the graph: the inputs and each layer output."""
    return [t for t, _, _ in self._tensors.values()]

  def position(self, layer_name: str) -> int:
    """Topological position of a layer; raises KeyError for unknown names."""
    if layer_name not in self._position:
      raise KeyError(layer_name)
    return self._position[layer_name]

  def crossing(self, position: int) -> list[keras.KerasTensor]:
    """The tensors that cross a cut placed just before node `position`.

    In a fixed order: model inputs first (in `model.inputs` order), then
    layer outputs in topological order. Position 0 gives every model input,
    position `len(nodes)` every model output.
    """
    if position == 0:
      return list(self.inputs)
    if position == len(self.nodes):
      return list(self.outputs)
    return [t for t, first, last in self._tensors.values()
            if first < position <= last]

  def crossing_bytes(self, position: int) -> int:
    """Bytes per example of the tensors crossing a cut at `position`."""
    return sum(self.tensor_bytes(t) for t in self.crossing(position))

  def name_of(self, tensor: keras.KerasTensor) -> str:
    """The layer that makes `tensor` (`"<layer>:<i>"` for its `i`-th of
    several outputs), or the model input's name."""
    op, node_index, index = tensor._keras_history  # pylint: disable=protected-access
    node = op._inbound_nodes[node_index]  # pylint: disable=protected-access
    many = len(node.output_tensors) > 1
    return f"{op.name}:{index}" if many else op.name

  def describe(self, tensor: keras.KerasTensor) -> str:
    """`"output of '<layer>' (<shape>)"` or `"input '<name>' (<shape>)"`."""
    what = ("input" if any(tensor is t for t in self.inputs)
            else "output of")
    return f"{what} {self.name_of(tensor)!r} {self.shape(tensor)}"
