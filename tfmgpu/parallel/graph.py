"""The layer graph of a Keras model: topological order and what crosses a cut.

A functional (or Sequential) model can be cut before any of its layer calls:
the layers before the cut form one stage, the layers after it the next, and
every tensor made before the cut and read after it *crosses* it: the
activation, skip (residual) tensors, and model inputs that later layers read
(a padding mask, position ids, a tabular input joined late). `ModelGraph`
lists a model's layer calls in topological order and, for any position, the
tensors that cross a cut placed there and their bytes. It looks inside
nested functional models: their layer calls are the graph's, their inputs
stand for their calls' arguments (`ModelGraph.canon`). `shapes_only` builds
a model to plan (its layers and weight shapes, no weight values).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import _compat


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
  with _compat.no_deferred_initialization():
    with keras.StatelessScope(initialize_variables=False):
      return build()


def output_names(model: keras.Model) -> tuple[str, ...]:
  """The names that key a model's outputs in a loss or metric dict.

  The dict's keys for a model returning a dict (a keras_hub `BertBackbone`
  returns `{"sequence_output": ..., "pooled_output": ...}`; Keras'
  `output_names` would name the layers that make them instead), in the
  order of `model.outputs` (`dict_output_keys`), which a list given for
  them follows (`loss_weights=[...]`); the output
  layers' names for a list, and a functional model's single output's (the
  layer that makes it: the name a Trainer of the unsplit model gives it;
  `()` for a Sequential's, which has no `output_names`).
  """
  flat = tf.nest.flatten(getattr(model, "outputs", None) or [])
  if len(flat) < 2:  # One output, or a subclassed model (no graph).
    return tuple(getattr(model, "output_names", None) or ())[:1]
  try:
    output = model.output
  except (AttributeError, ValueError):  # Sequential before its first call.
    output = None
  if isinstance(output, Mapping):
    return tuple(dict_output_keys(output, flat))
  return tuple(model.output_names)


def dict_output_keys(output: Mapping, flat: Sequence[Any]) -> list[str]:
  """The keys of a model's dict `output` in the order of its `outputs`
  (`flat`), as Keras orders them: sorted for a dict, as written for an
  `OrderedDict`. In the dict's own order, `loss_weights=[1, 0]` trained
  the other head, silently (a new user's trial)."""
  key_of = {id(tensor): key for key, tensor in output.items()}
  keys = [key_of.get(id(tensor)) for tensor in flat]
  return keys if None not in keys else sorted(output)


def output_shapes(model: Any) -> tuple[tuple[int | None, ...], ...]:
  """The shapes of a model's outputs (batch axis `None`), in the order of
  `tf.nest.flatten(model.outputs)`; a placed model (staged, pipelined,
  ZeRO, tensor-parallel), which has no symbolic outputs, answers for the
  model it was made from (`unsplit_output_shapes`). `()` if unknown (a
  subclassed model)."""
  shapes = getattr(model, "unsplit_output_shapes", None)
  if shapes:
    return tuple(tuple(s) for s in shapes)
  outputs = getattr(model, "outputs", None)
  return tuple(tuple(t.shape) for t in tf.nest.flatten(outputs or []))


def input_dtypes(model: Any) -> tuple[str, ...]:
  """The dtypes of a model's inputs (`"float32"`, `"int32"`, `"string"`),
  in the order of `tf.nest.flatten(model.inputs)`; a placed model answers
  for the model it was made from (`unsplit_input_dtypes`). `()` if
  unknown (a subclassed model)."""
  dtypes = getattr(model, "unsplit_input_dtypes", None)
  if dtypes:
    return tuple(dtypes)
  try:
    inputs = model.inputs
  except (AttributeError, ValueError):  # Subclassed: no symbolic inputs.
    return ()
  return tuple(keras.backend.standardize_dtype(t.dtype)
               for t in tf.nest.flatten(inputs or []))


def input_keys(model: Any) -> tuple[str, ...] | None:
  """The keys of the dict a model takes as its inputs, or `None` when it
  takes no dict (one tensor, a list) or its inputs are not known (a
  subclassed model); a placed model answers for the model it was made
  from (`unsplit_input_keys`)."""
  keys = getattr(model, "unsplit_input_keys", None)
  if keys is not None:
    return tuple(keys)
  try:
    structure = model.input
  except (AttributeError, ValueError):  # Subclassed, or not yet called.
    return None
  return tuple(structure) if isinstance(structure, Mapping) else None


def _producer(tensor: keras.KerasTensor):
  # Keras 3 has no public graph-walking API (see `_compat.producer_node`).
  return _compat.producer_node(tensor)


def _symbolic_inputs_outputs(model: keras.Model):
  """`(inputs, outputs)`: the flat symbolic tensors of a built model."""
  if not isinstance(model, keras.Model):
    raise TypeError(f"model={model!r} is not a keras.Model.")
  if not model.built:
    raise ValueError(
        f"model {model.name!r} is not built. Build it first (give it a "
        "keras.Input, or call model.build(input_shape)) so its layer "
        "shapes are known.")
  if _compat.overrides_call(model):
    raise ValueError(
        f"model {model.name!r} ({type(model).__name__}) overrides call(): a "
        "split replays the graph from its inputs to its outputs, not call(), "
        "so it would train or predict something else. Put what call() adds "
        "in a layer of the graph, or keep the model whole: data parallelism, "
        "or ZeRO (tfmgpu.Trainer(model, zero_stage=3)), which call it.")
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


def _inlinable(op: Any) -> bool:
  """A functional model called as a layer, whose graph is its call."""
  return _compat.is_functional(op)


def _call_pairs(node) -> tuple[list[Any], list[Any]] | None:
  """`(inputs, outputs)`: `(inner, outer)` tensor pairs of a nested
  functional model's call (its inputs with the call's arguments, the call's
  outputs with its outputs), or `None` when the call passes its tensors in
  another way (as keywords, a mask, another structure)."""
  inner, args = node.operation, node.arguments
  tree = keras.tree
  positional, keywords = list(args.args), dict(args.kwargs)
  if not positional and "inputs" in keywords:  # backbone(inputs=...): Gemma3.
    positional = [keywords.pop("inputs")]
  if len(positional) != 1 or any(isinstance(v, keras.KerasTensor)
                                 for v in tree.flatten(keywords)):
    return None
  given, wanted = positional[0], inner._inputs_struct  # pylint: disable=protected-access
  if isinstance(wanted, Mapping) != isinstance(given, Mapping) or (
      isinstance(wanted, Mapping) and set(wanted) != set(given)):
    return None
  ins, outer = tree.flatten(wanted), tree.flatten(given)
  outs = tree.flatten(inner._outputs_struct)  # pylint: disable=protected-access
  if len(ins) != len(outer) or len(outs) != len(node.output_tensors) or (
      not all(isinstance(t, keras.KerasTensor) for t in outer)):
    return None
  return list(zip(ins, outer)), list(zip(node.output_tensors, outs))


def _walk(model_inputs, model_outputs, blocked: set[int]):
  """`(found, aliases, inlined)`: the layer calls reachable backwards from
  the outputs, `{id: node}`, looking inside nested functional models (but
  not those in `blocked`); `{id(tensor): tensor it stands for}` (a nested
  model's inputs stand for its call's arguments, the call's outputs for
  its outputs); `{id(nested model): its call}`."""
  input_ops = {id(_compat.keras_history(t)[0]) for t in model_inputs}
  found, aliases, inlined = {}, {}, {}
  stack = list(model_outputs)
  while stack:
    t = stack.pop()
    while id(t) in aliases:
      t = aliases[id(t)]
    node = _producer(t)
    if id(node) in found or id(node.operation) in input_ops:
      continue
    pairs = (_call_pairs(node) if _inlinable(node.operation)
             and id(node.operation) not in blocked else None)
    if pairs is not None and inlined.get(id(node.operation), node) is node:
      inlined[id(node.operation)] = node
      for a, b in pairs[0] + pairs[1]:
        if a is not b:  # keras_hub tasks take their backbone's own inputs.
          aliases[id(a)] = b
      stack.append(t)
      continue
    if pairs is not None:  # A nested model called twice: keep it whole.
      blocked.add(id(node.operation))
      return None
    found[id(node)] = node
    stack.extend(node.input_tensors)
  return found, aliases, inlined


def _layers_by_name(model: keras.Model) -> dict[str, set[int]]:
  """`{name: {id(layer)}}` of a model's layers and its nested models'."""
  found: dict[str, set[int]] = {}
  for layer in model.layers:
    found.setdefault(layer.name, set()).add(id(layer))
    if isinstance(layer, keras.Model):
      for name, ids in _layers_by_name(layer).items():
        found.setdefault(name, set()).update(ids)
  return found


def _reachable_nodes(model: keras.Model, model_inputs, model_outputs):
  """`(found, aliases, inlined)` of `_walk`, nested models inlined where
  their layers' names stay unique.

  A layer called more than once (the token embedding a keras_hub CausalLM
  calls in its backbone and again, reversed, as its LM head) gives one
  node per call (`ModelGraph.names`: `name`, `name.2`, ...): its weights
  are shared between the calls (`tfmgpu.parallel.shared`). A nested model
  called twice, or holding another layer of the same name as one used
  outside it, stays one layer.

  Raises:
    ValueError: a nested model is called more than once.
  """
  blocked: set[int] = set()
  while True:
    walked = _walk(model_inputs, model_outputs, blocked)
    if walked is None:
      continue
    found, aliases, inlined = walked
    objects: dict[str, set[int]] = {}
    for node in found.values():
      objects.setdefault(node.operation.name, set()).add(id(node.operation))
    clash = {n for n, ids in objects.items() if len(ids) > 1}
    culprits = {k for k, n in inlined.items()
                if set(_layers_by_name(n.operation)) & clash}
    if not culprits:
      break
    blocked |= culprits
  models = sorted({n.operation.name for n in found.values()
                   if isinstance(n.operation, keras.Model)
                   and sum(m.operation is n.operation
                           for m in found.values()) > 1})
  if models or clash:
    raise ValueError(
        f"model {model.name!r} calls nested model(s) or layers named "
        f"{models or sorted(clash)} more than once; a shared model cannot be "
        "placed on one stage device. Give each call its own model, and "
        "each layer its own name.")
  return found, aliases, inlined


def _ops_inlined(model: keras.Model, inlined: dict[int, Any]) -> list[Any]:
  """The model's operations in its own order, an inlined nested model's
  spliced in where it is called."""
  # Functional models list bare ops (keras.ops.*) with their layers.
  ops = []
  for op in _compat.model_operations(model):
    ops.extend(_ops_inlined(op, inlined) if id(op) in inlined else [op])
  return ops


def _topological_order(model: keras.Model, found: dict[int, Any],
                       canon: Callable[[Any], Any],
                       inlined: dict[int, Any]) -> list[Any]:
  """Kahn's algorithm, ties broken by the model's own layer order."""
  order = {id(l): i for i, l in enumerate(_ops_inlined(model, inlined))}
  producers = {id(t): k for k, n in found.items() for t in n.output_tensors}
  users: dict[int, list[int]] = {k: [] for k in found}
  missing = {}
  for k, n in found.items():
    deps = {producers[id(canon(t))] for t in n.input_tensors
            if id(canon(t)) in producers}
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


def _call_names(nodes: Sequence[Any]) -> list[str]:
  """Each node's name: its layer's, `.<k>` added for the layer's `k`-th
  call (`token_embedding`, then `token_embedding.2` for a tied LM head)."""
  calls: dict[int, int] = {}
  names = []
  for node in nodes:
    k = calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    names.append(node.operation.name if k == 1
                 else f"{node.operation.name}.{k}")
  return names


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
    names = [_compat.keras_history(t)[0].name for t in inputs]
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


def _resolved_shapes(graph: "ModelGraph",
                     shapes: list[tuple[int | None, ...]]
                     ) -> dict[int, tuple[int | None, ...]]:
  """`{id(tensor): shape}` with the inputs' `shapes` carried through each
  layer's `compute_output_spec`; a layer that cannot say keeps the
  symbolic shapes of its outputs (and their unknown dimensions)."""
  specs = graph.tensor_map()
  for t, shape in zip(graph.inputs, shapes):
    specs[id(t)] = keras.KerasTensor(shape, dtype=t.dtype)
  for node in graph.nodes:
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


class TensorMap(dict):
  """`{id(tensor): value}` whose keys are filed under `key(id)`."""

  def __init__(self, key: Callable[[int], int]):
    super().__init__()
    self._canonical = key

  def __getitem__(self, key: int) -> Any:
    return super().__getitem__(self._canonical(key))

  def __setitem__(self, key: int, value: Any) -> None:
    super().__setitem__(self._canonical(key), value)

  def __contains__(self, key: object) -> bool:
    return super().__contains__(self._canonical(key))  # type: ignore[arg-type]

  def get(self, key: int, default: Any = None) -> Any:
    return super().get(self._canonical(key), default)


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
    names: the name of each node: its layer's, with `.<k>` for the `k`-th
      call of a layer called more than once (a keras_hub CausalLM's
      `token_embedding`, then `token_embedding.2`, its tied LM head).
    inlined: the nested functional models whose layer calls stand in
      `nodes` one by one (a backbone inside a task model, a block inside an
      encoder), so a stage may start between their layers. A nested model
      called twice stays one node.
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
    self.inputs, outputs = _symbolic_inputs_outputs(model)
    self.input_structure = _structure(model, "input", self.inputs)
    self.model = model
    found, aliases, inlined = _reachable_nodes(model, self.inputs, outputs)
    self._aliases = {k: id(t) for k, t in aliases.items()}
    self._objects = {id(t): t for t in aliases.values()}
    self.outputs = [self.canon(t) for t in outputs]
    self.output_structure = tf.nest.map_structure(
        self.canon, _structure(model, "output", outputs))
    self.nodes = _topological_order(model, found, self.canon, inlined)
    self.names = _call_names(self.nodes)
    self.inlined = tuple(n.operation.name for n in inlined.values())
    self._owners = {id(l): n.operation for n in inlined.values()
                    for l in n.operation.layers}
    self._shapes: dict[int, tuple[int | None, ...]] = {}
    if input_shape is not None or any(
        _has_unknown(t.shape) for n in self.nodes for t in n.output_tensors):
      given = _given_shapes(self.inputs, input_shape,
                            config_sequence_length(model))
      self._shapes = _resolved_shapes(self, given)
    self._position = {name: i for i, name in enumerate(self.names)}
    self._tensors = self._lifetimes()

  def layers(self) -> dict[str, keras.layers.Layer]:
    """`{node name: layer}` of the nodes that call layers (not bare ops),
    in topological order; a layer called twice is there under both names."""
    return {name: n.operation for name, n in zip(self.names, self.nodes)
            if isinstance(n.operation, keras.layers.Layer)}

  def owner(self, layer: keras.layers.Layer) -> keras.Model | None:
    """The inlined nested model that holds `layer` (a keras_hub backbone
    holding its blocks), or `None` for a layer of the model itself."""
    return self._owners.get(id(layer))

  def first_call(self, position: int) -> bool:
    """Whether node `position` is its layer's first call."""
    return self.names[position] == self.nodes[position].operation.name

  def _lifetimes(self) -> dict[int, list[Any]]:
    """`{id: [tensor, made, last read]}`: each tensor lives from its
    producer's position to its last consumer's (model inputs from -1,
    model outputs to `len(nodes)`)."""
    tensors = {id(t): [t, -1, -1] for t in self.inputs}
    for i, node in enumerate(self.nodes):
      for t in node.output_tensors:
        tensors.setdefault(id(t), [t, i, i])
    for i, node in enumerate(self.nodes):
      for t in map(self.canon, node.input_tensors):
        if id(t) in tensors:
          tensors[id(t)][2] = max(tensors[id(t)][2], i)
    for t in self.outputs:
      tensors[id(t)][2] = len(self.nodes)
    return tensors

  def canon(self, tensor: Any) -> Any:
    """The tensor of the graph `tensor` stands for: a nested model's input
    stands for its call's argument, its call's output for its own output
    (the same tensor when nothing is nested)."""
    if not isinstance(tensor, keras.KerasTensor):
      return tensor
    key = self._key(id(tensor))
    return tensor if key == id(tensor) else self._objects[key]

  def _key(self, key: int) -> int:
    while key in self._aliases:
      key = self._aliases[key]
    return key

  def tensor_map(self) -> "TensorMap":
    """An empty `{id(tensor): value}` dict that files a value under the
    tensor the key stands for (`canon`): what `node.arguments.fill_in`
    reads when the graph's nodes are replayed."""
    return TensorMap(self._key)

  def shape(self, tensor: keras.KerasTensor) -> tuple[int | None, ...]:
    """A tensor's shape with the lengths the data or the model's config
    give (`input_shape`); `None` where they stay unknown."""
    tensor = self.canon(tensor)
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
    op, _, index = _compat.keras_history(tensor)
    node = _compat.producer_node(tensor)
    many = len(node.output_tensors) > 1
    return f"{op.name}:{index}" if many else op.name

  def describe(self, tensor: keras.KerasTensor) -> str:
    """`"output of '<layer>' (<shape>)"` or `"input '<name>' (<shape>)"`."""
    what = ("input" if any(tensor is t for t in self.inputs)
            else "output of")
    return f"{what} {self.name_of(tensor)!r} {self.shape(tensor)}"
