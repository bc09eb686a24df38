"""Cost model: parameter bytes, forward FLOPs and activation bytes per block.

The layers between two consecutive cut points of a `ModelGraph` form a
`Block`, the unit the partitioner moves between stages. Costs, per block and
per example:

* parameter bytes: every weight (trainable or not) times its dtype size;
* forward FLOPs (a multiply-add counts as 2):
  - `Dense`: `2 * in * units` per position (+ `units` for the bias, + one per
    output for a non-linear activation);
  - `Conv1D/2D/3D`: `2 * prod(kernel) * in_channels / groups * filters` per
    output position (+ bias, + activation); transposed convs per *input*
    position; depthwise and separable convs as their two factors;
  - normalisation layers: 5 per element; pooling: pool size per output;
    merge layers (`Add`, ...): inputs - 1 per element; reshape-like layers
    (`Flatten`, `Reshape`, `Dropout`, `Concatenate`, `Embedding`, ...): 0;
  - a nested model: the sum over its own layers;
  - anything else: one FLOP per output element (a coarse estimate);
* activation bytes: the outputs of every layer (kept for the backward pass)
  and, at each cut, the single tensor sent to the next stage.

`Criterion` names what a split balances and `block_costs` turns blocks into
the numbers the partitioner balances.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

from absl import logging
import keras

from tfmgpu.parallel import graph as graph_lib


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


def _elementwise_flops(layer, num_inputs: int, in_shape, out_el: int) -> int:
  """FLOPs of a normalisation, pooling, merge or reshape-like layer.

  Anything else counts one FLOP per output element.
  """
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
  return out_el


def node_flops(node) -> int:
  """Forward FLOPs per example of one layer call (see the module docstring)."""
  layer = node.operation
  ins, outs = node.input_tensors, node.output_tensors
  out_el = sum(graph_lib.elements(t.shape) for t in outs)
  in_shape = tuple(ins[0].shape) if ins else ()
  if isinstance(layer, keras.Model):
    try:
      return sum(node_flops(n) for n in graph_lib.ModelGraph(layer).nodes)
    except (TypeError, ValueError):  # Subclassed or multi-input: estimate.
      return out_el
  flops = _kernel_flops(layer, in_shape, tuple(outs[0].shape), out_el)
  if flops is not None:
    return flops
  return _elementwise_flops(layer, len(ins), in_shape, out_el)


@dataclasses.dataclass(frozen=True)
class Block:
  """The layers between two consecutive cut points: the unit of partitioning.

  Attributes:
    layers: layer names in topological order.
    param_bytes: bytes of all weights.
    trainable_param_bytes: bytes of the trainable weights.
    flops: forward FLOPs per example.
    activation_bytes: bytes per example of every layer output in the block.
    output_bytes: bytes per example of the one tensor leaving the block.
    output_shape: shape of that tensor (batch axis `None`).
  """
  layers: tuple[str, ...]
  param_bytes: int
  trainable_param_bytes: int
  flops: int
  activation_bytes: int
  output_bytes: int
  output_shape: tuple[int | None, ...]


def model_blocks(model: keras.Model | graph_lib.ModelGraph) -> list[Block]:
  """Splits a model at its cut points and costs each block.

  Args:
    model: a built single-input, single-output Sequential or functional model
      (or its `ModelGraph`).

  Returns:
    The blocks in order; their layers cover the model's layers exactly once.
  """
  graph = (model if isinstance(model, graph_lib.ModelGraph)
           else graph_lib.ModelGraph(model))
  starts = [0] + graph.cut_positions()
  ends = starts[1:] + [len(graph.nodes)]
  unknown = [t for t in graph.tensors()
             if any(d is None for d in tuple(t.shape)[1:])]
  if unknown:
    logging.warning("Model %r has tensors with unknown dimensions (e.g. %s); "
                    "costs count them as 1.", graph.model.name,
                    graph.describe(unknown[0]))
  blocks = []
  for start, end in zip(starts, ends):
    nodes = graph.nodes[start:end]
    out = graph.boundary(end)
    blocks.append(Block(
        layers=tuple(n.operation.name for n in nodes),
        param_bytes=sum(param_bytes(n.operation) for n in nodes),
        trainable_param_bytes=sum(param_bytes(n.operation, True)
                                  for n in nodes),
        flops=sum(node_flops(n) for n in nodes),
        activation_bytes=sum(graph_lib.tensor_bytes(t) for n in nodes
                             for t in n.output_tensors),
        output_bytes=graph_lib.tensor_bytes(out),
        output_shape=tuple(out.shape)))
  return blocks


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
