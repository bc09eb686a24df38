"""Cost model: parameter bytes, forward FLOPs and activation bytes per layer,
and the bytes that cross each cut.

Each layer call of a `ModelGraph` is a `Block`, the unit the partitioner
moves between stages; a stage boundary may fall before any of them. Costs,
per block and per example:

* parameter bytes: every weight (trainable or not) times its dtype size;
* forward FLOPs (a multiply-add counts as 2):
  - `Dense`: `2 * in * units` per position (+ `units` for the bias, + one per
    output for a non-linear activation);
  - `Conv1D/2D/3D`: `2 * prod(kernel) * in_channels / groups * filters` per
    output position (+ bias, + activation); transposed convs per *input*
    position; depthwise and separable convs as their two factors;
  - `LSTM`, `GRU`, `SimpleRNN` (or a `keras.layers.RNN` of their cells):
    `gates * 2 * (in + units) * units` per time step (4 gates for an LSTM,
    3 for a GRU, 1 for a SimpleRNN); a `Bidirectional` wrapper, both
    directions;
  - `MultiHeadAttention`: its query, key, value and output projections
    (`2 * in * out` per position each), the scores and the weighted sum
    (`2 * T_query * T_key * heads * head_dim` each; a causal mask computes
    them all) and the softmax (5 per score), + biases;
  - normalisation layers: 5 per element; pooling: pool size per output;
    merge layers (`Add`, ...): inputs - 1 per element; reshape-like layers
    (`Flatten`, `Reshape`, `Dropout`, `Concatenate`, `Embedding`, ...): 0;
  - a nested model: the sum over its own layers;
  - a custom layer with `Dense` / `EinsumDense` sublayers (keras_hub's
    transformer blocks): their matmuls at every position, attention's
    `T^2` terms, + one per output element (`block_flops.sublayer_flops`);
    a `ReversibleEmbedding` called in reverse (an LM head): `2 * vocabulary
    * width` per position;
  - anything else: one FLOP per output element (a coarse estimate;
    `model_blocks` logs the names of such layers that hold weights, once);
* activation bytes: the outputs of every layer (kept for the backward
  pass), and inside `MultiHeadAttention` its query, key and value
  projections, its scores and their softmax (`heads * T^2` each: what
  dominates a transformer's memory at long contexts) and the weighted sum;
  inside a custom block, its `Dense` / `EinsumDense` outputs and its
  attention scores and softmax;
* at each cut, the bytes of every tensor crossing it (`cut_bytes`): what one
  stage sends to the next, and receives back as gradients.

`Criterion` names what a split balances; `block_costs` and `cut_costs` turn
blocks and cuts into the numbers the partitioner balances. A cut costs
`transfer_weight` times what the model's layers cost, on average, per byte
of output they make (`TRANSFER_WEIGHT` by default): a cut that sends two
tensors costs more than one that sends one of them, and a stage pays for
what it receives and what it sends.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any, Callable

from absl import logging
import keras

from tfmgpu.parallel import block_flops
from tfmgpu.parallel import graph as graph_lib

# What a byte crossing a cut costs, relative to what the model's layers cost
# on average per byte of output they make (see the module docstring). Small:
# a pipeline overlaps its transfers with compute, so cut bytes mostly decide
# between splits of about equal balance.
TRANSFER_WEIGHT = 0.1

# A tensor's shape for costing: `ModelGraph.shape` (with the lengths the
# data or the model's config give), or the symbolic shape.
ShapeOf = Callable[[Any], tuple]


def _symbolic(tensor) -> tuple:
  return tuple(tensor.shape)


class Criterion(str, enum.Enum):
  """What `plan_stages` balances.

  Its values are `tfmgpu.parallel.choices.PARTITION_CHOICES`, in that order.
  """
  BALANCED = "balanced"  # Mean of the normalised parameter and FLOP shares.
  PARAMS = "params"      # Parameter bytes (memory per device).
  FLOPS = "flops"        # Forward FLOPs (compute time per device).


def param_bytes(layer: keras.layers.Layer, trainable_only: bool = False) -> int:
  """Bytes of a layer's weights (all of them, or only the trainable ones)."""
  # Bare ops (keras.ops.* in a functional model) have no weights.
  weights = (getattr(layer, "trainable_weights", []) if trainable_only
             else getattr(layer, "weights", []))
  return sum(math.prod(v.shape) * graph_lib.dtype_size(v.dtype)
             for v in weights)


def _activation_flops(layer, out_elements: int) -> int:
  act = getattr(layer, "activation", None)
  name = getattr(act, "__name__", "linear")
  return 0 if act is None or name == "linear" else out_elements


def _spatial(shape) -> int:
  return math.prod(1 if d is None else int(d) for d in tuple(shape)[1:-1])


def _kernel_flops(layer, in_shape, out_shape, out_el: int) -> int | None:
  """FLOPs of a Dense or convolution layer (with its activation), else None."""
  L = keras.layers
  if isinstance(layer, L.Dense):
    fan_in = int(in_shape[-1])
    positions = _spatial(in_shape)
    flops = 2 * positions * fan_in * layer.units
    flops += positions * layer.units if layer.use_bias else 0
  elif isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
    cin = int(in_shape[-1])
    k = math.prod(layer.kernel_size)
    flops = 2 * _spatial(out_shape) * (k * cin * layer.depth_multiplier +
                                       cin * layer.depth_multiplier *
                                       layer.filters)
  elif isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
    k = math.prod(layer.kernel_size)
    flops = 2 * _spatial(out_shape) * k * int(out_shape[-1])
  elif isinstance(layer, (L.Conv1DTranspose, L.Conv2DTranspose,
                          L.Conv3DTranspose)):
    k = math.prod(layer.kernel_size)
    flops = 2 * _spatial(in_shape) * k * int(in_shape[-1]) * layer.filters
    flops += out_el if layer.use_bias else 0
  elif isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)):
    k = math.prod(layer.kernel_size)
    cin = int(in_shape[-1]) // getattr(layer, "groups", 1)
    flops = 2 * _spatial(out_shape) * k * cin * layer.filters
    flops += out_el if layer.use_bias else 0
  else:
    return None
  return flops + _activation_flops(layer, out_el)


def _recurrent_flops(layer, in_shape) -> int | None:
  """FLOPs of an LSTM, GRU or SimpleRNN layer (or a `Bidirectional` of
  them) over its time steps, else None (see the module docstring)."""
  L = keras.layers
  if isinstance(layer, L.Bidirectional):
    parts = [_recurrent_flops(part, in_shape)
             for part in (layer.forward_layer, layer.backward_layer)]
    return None if None in parts else sum(parts)
  if not isinstance(layer, L.RNN):
    return None
  gates = next((n for cell, n in ((L.LSTMCell, 4), (L.GRUCell, 3),
                                  (L.SimpleRNNCell, 1))
                if isinstance(layer.cell, cell)), None)
  if gates is None:  # ConvLSTM, stacked or custom cells: the estimate.
    return None
  steps = _spatial(in_shape)  # (batch, time, features)
  units = int(layer.cell.units)
  return steps * gates * 2 * (int(in_shape[-1]) + units) * units


def _attention_dims(node, shape: ShapeOf = _symbolic) -> dict[str, int]:
  """Heads, head sizes, lengths and widths of a `MultiHeadAttention` call."""
  layer, args = node.operation, node.arguments
  # Called positionally or by keyword (`mha(query=q, value=v)`).
  named = ("query", "value", "key")
  query, value, key = (args.args[i] if len(args.args) > i
                       else args.kwargs.get(name)
                       for i, name in enumerate(named))
  key = value if key is None else key
  tq, tk, tv = (_spatial(shape(t)) for t in (query, key, value))
  dq, dk, dv = (int(t.shape[-1]) for t in (query, key, value))
  return dict(h=layer.num_heads, kd=layer.key_dim,
              vd=layer.value_dim or layer.key_dim, tq=tq, tk=tk, tv=tv,
              dq=dq, dk=dk, dv=dv,
              dout=int(node.output_tensors[0].shape[-1]))


def _attention_flops(node, shape: ShapeOf = _symbolic) -> int:
  """FLOPs of one `MultiHeadAttention` call (see the module docstring)."""
  d = _attention_dims(node, shape)
  h, kd, vd, tq, tk, tv = (d[k] for k in ("h", "kd", "vd", "tq", "tk", "tv"))
  projections = 2 * h * (tq * d["dq"] * kd + tk * d["dk"] * kd +
                         tv * d["dv"] * vd + tq * vd * d["dout"])
  scores = h * tq * tk * (2 * kd + 5 + 2 * vd)
  bias = (h * (tq * kd + tk * kd + tv * vd) + tq * d["dout"]
          if node.operation.use_bias else 0)
  return projections + scores + bias


def attention_internal_elements(node, shape: ShapeOf = _symbolic) -> int:
  """Elements per example a `MultiHeadAttention` call keeps inside it for
  its backward: the query, key and value projections, the scores and their
  softmax (`heads * T_query * T_key` each) and the weighted sum before the
  output projection."""
  d = _attention_dims(node, shape)
  h = d["h"]
  return (h * (d["tq"] * d["kd"] + d["tk"] * d["kd"] + d["tv"] * d["vd"]) +
          2 * h * d["tq"] * d["tk"] + h * d["tq"] * d["vd"])


def node_activation_bytes(node, shape: ShapeOf = _symbolic) -> int:
  """Bytes per example a layer call keeps for the backward pass: its
  outputs, and inside a `MultiHeadAttention` its projections and scores,
  inside a custom block (keras_hub's) its sublayers' matmul outputs and
  attention scores (`block_flops.sublayer_activation_elements`; in the
  dtype of its output). `shape` gives each tensor's shape
  (`ModelGraph.shape`); defaults to the symbolic one."""
  outs = sum(graph_lib.elements(shape(t)) * graph_lib.dtype_size(t.dtype)
             for t in node.output_tensors)
  size = graph_lib.dtype_size(node.output_tensors[0].dtype)
  if isinstance(node.operation, keras.layers.MultiHeadAttention):
    return outs + size * attention_internal_elements(node, shape)
  if isinstance(node.operation, keras.Model) or not node.input_tensors:
    return outs
  return outs + size * block_flops.sublayer_activation_elements(
      node.operation, shape(node.input_tensors[0]))


def _elementwise_flops(layer, num_inputs: int, in_shape,
                       out_el: int) -> int | None:
  """FLOPs of a normalisation, pooling, merge or reshape-like layer, else
  None."""
  L = keras.layers
  if isinstance(layer, (L.BatchNormalization, L.LayerNormalization,
                        L.GroupNormalization, L.UnitNormalization)):
    return 5 * out_el
  if isinstance(layer, (L.GlobalAveragePooling1D, L.GlobalAveragePooling2D,
                        L.GlobalAveragePooling3D, L.GlobalMaxPooling1D,
                        L.GlobalMaxPooling2D, L.GlobalMaxPooling3D)):
    return graph_lib.elements(in_shape)
  if hasattr(layer, "pool_size"):
    return math.prod(layer.pool_size) * out_el
  if isinstance(layer, (L.Add, L.Subtract, L.Multiply, L.Average, L.Maximum,
                        L.Minimum)):
    return max(num_inputs - 1, 1) * out_el
  if isinstance(layer, (L.Flatten, L.Reshape, L.Permute, L.Dropout,
                        L.Concatenate, L.InputLayer, L.Embedding,
                        L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D,
                        L.Cropping1D, L.Cropping2D, L.Cropping3D,
                        L.RepeatVector, L.Identity, L.SpatialDropout1D,
                        L.SpatialDropout2D, L.SpatialDropout3D,
                        L.GaussianNoise, L.GaussianDropout)):
    return 0
  return None


def node_flops(node, shape: ShapeOf = _symbolic) -> int:
  """Forward FLOPs per example of one layer call (see the module docstring).

  `shape` gives each tensor's shape (`ModelGraph.shape`); defaults to the
  symbolic one.
  """
  flops = _known_flops(node, shape)
  if flops is None:  # The coarse estimate.
    return sum(graph_lib.elements(shape(t)) for t in node.output_tensors)
  return flops


def _known_flops(node, shape: ShapeOf) -> int | None:
  """`node_flops`, or None where it is one FLOP per output element (a layer
  this module does not know)."""
  layer = node.operation
  ins, outs = node.input_tensors, node.output_tensors
  out_el = sum(graph_lib.elements(shape(t)) for t in outs)
  in_shape = shape(ins[0]) if ins else ()
  if isinstance(layer, keras.Model):
    try:  # Its own graph, fed the shapes this call gives it.
      inner = graph_lib.ModelGraph(layer, input_shape=[
          shape(t)[1:] for t in ins] if len(ins) == len(layer.inputs)
                                   else None)
      return sum(node_flops(n, inner.shape) for n in inner.nodes)
    except (TypeError, ValueError):  # Subclassed or multi-input: estimate.
      return None
  if isinstance(layer, keras.layers.MultiHeadAttention):
    return _attention_flops(node, shape)
  flops = _kernel_flops(layer, in_shape, shape(outs[0]), out_el)
  if flops is None:
    flops = _recurrent_flops(layer, in_shape)
  if flops is None:
    flops = block_flops.reverse_embedding_flops(node, in_shape)
  if flops is None:
    flops = block_flops.sublayer_flops(layer, in_shape, out_el)
  if flops is not None:
    return flops
  return _elementwise_flops(layer, len(ins), in_shape, out_el)


@dataclasses.dataclass(frozen=True)
class Block:
  """One layer call: the unit of partitioning.

  Attributes:
    layers: its layer name (a tuple, in topological order).
    param_bytes: bytes of all weights.
    trainable_param_bytes: bytes of the trainable weights.
    flops: forward FLOPs per example.
    activation_bytes: bytes per example the layer keeps for the backward
      pass (`node_activation_bytes`: its outputs, and attention's
      internals).
    output_bytes: bytes per example of its (first) output.
    output_shape: shape of that output (batch axis `None`).
  """
  layers: tuple[str, ...]
  param_bytes: int
  trainable_param_bytes: int
  flops: int
  activation_bytes: int
  output_bytes: int
  output_shape: tuple[int | None, ...]


# The layers `_log_estimated` has named, by model: it names them once.
_ESTIMATED_LOGGED: set[tuple[str, ...]] = set()


def _log_estimated(graph: graph_lib.ModelGraph) -> None:
  """Logs (once per model and layers) the layers with weights that
  `node_flops` costs at one FLOP per output element: their FLOPs may be far
  too small, and a `"flops"` or `"balanced"` plan unbalanced. Not custom
  embeddings (`PositionEmbedding`, ...: lookups and adds) nor
  normalizations (`RMSNormalization`, ...), which that counts about
  right."""
  names = tuple(f"{name} ({type(node.operation).__name__})"
                for name, node in zip(graph.names, graph.nodes)
                if param_bytes(node.operation) and
                not type(node.operation).__name__.endswith(
                    ("Embedding", "Normalization", "Norm")) and
                _known_flops(node, graph.shape) is None)
  if not names or (graph.model.name, *names) in _ESTIMATED_LOGGED:
    return
  _ESTIMATED_LOGGED.add((graph.model.name, *names))
  logging.warning(
      "Model %r: the cost model does not know layer(s) %s, which hold "
      "weights: their FLOPs are estimated at 1 per output element, which may "
      "be far too few, so a criterion='flops' or 'balanced' stage plan may be "
      "unbalanced. Check the plan's FLOPs/ex, or use criterion='params' or "
      "split_points=[...].", graph.model.name, ", ".join(names))


def model_blocks(model: keras.Model | graph_lib.ModelGraph) -> list[Block]:
  """Costs each layer call of a model, in topological order.

  Args:
    model: a built Sequential or functional model (or its `ModelGraph`).

  Returns:
    One block per layer call; their layers cover the model's layers once.
  """
  graph = (model if isinstance(model, graph_lib.ModelGraph)
           else graph_lib.ModelGraph(model))
  unknown = graph.unknown()
  if unknown:
    logging.warning(
        "Model %r has tensors of unknown length (e.g. %s) that neither the "
        "data nor the model's config (max_sequence_length) gives: its FLOPs, "
        "activation and transfer bytes are UNKNOWN and counted here as if "
        "that length were 1 (far too small). Give the length: "
        "plan_stages(model, ..., input_shape=<one example's shape>), and "
        "give that plan to build_layout(..., plan=plan) or PipelinedModel.",
        graph.model.name, graph.describe(unknown[0]))
  _log_estimated(graph)
  blocks = []
  for name, node in zip(graph.names, graph.nodes):
    out = node.output_tensors[0]
    blocks.append(Block(
        layers=(name,),  # A layer's second call: `name.2`, its weights again.
        param_bytes=param_bytes(node.operation),
        trainable_param_bytes=param_bytes(node.operation, True),
        flops=node_flops(node, graph.shape),
        activation_bytes=node_activation_bytes(node, graph.shape),
        output_bytes=graph.tensor_bytes(out),
        output_shape=graph.shape(out)))
  return blocks


def cut_bytes(graph: graph_lib.ModelGraph) -> list[int]:
  """Bytes per example crossing a cut before each node, positions 0..n.

  Entry 0 is the model's inputs, entry `n` its outputs.
  """
  return [graph.crossing_bytes(p) for p in range(len(graph.nodes) + 1)]


def block_costs(blocks: Sequence[Block], criterion: Criterion) -> list[float]:
  """The cost of each block under `criterion`, as the partitioner balances it.

  `"params"` and `"flops"` are the raw counts; `"balanced"` averages each
  block's share of the total parameters and of the total FLOPs (a metric
  with a zero total drops out; all equal if both are zero).
  """
  params = [b.param_bytes for b in blocks]
  flops = [b.flops for b in blocks]
  if criterion is Criterion.PARAMS:
    return [float(p) for p in params]
  if criterion is Criterion.FLOPS:
    return [float(f) for f in flops]
  shares = [[v / sum(vals) for v in vals] for vals in (params, flops)
            if sum(vals) > 0]
  if not shares:
    return [1.0] * len(blocks)
  return [sum(s[i] for s in shares) / len(shares) for i in range(len(blocks))]


def cut_costs(blocks: Sequence[Block], costs: Sequence[float],
              crossing: Sequence[int],
              transfer_weight: float = TRANSFER_WEIGHT) -> list[float]:
  """The cost of cutting between consecutive blocks, in the blocks' units.

  A byte crossing a cut costs `transfer_weight` times the blocks' total cost
  divided by their total activation bytes (what the layers cost, on average,
  per byte of output they make).

  Args:
    blocks: the blocks, in order.
    costs: their costs (`block_costs`).
    crossing: `cut_bytes` of the graph: bytes at positions 0..n.
    transfer_weight: see above; 0 balances compute alone.

  Returns:
    `n - 1` costs: entry `i - 1` is the cost of a cut before block `i`.
  """
  if transfer_weight < 0:
    raise ValueError(f"transfer_weight={transfer_weight!r} must be >= 0.")
  made = sum(b.activation_bytes for b in blocks)
  rate = transfer_weight * sum(costs) / made if made else 0.0
  return [rate * crossing[p] for p in range(1, len(blocks))]
