"""Cost model and exact balanced split of a Keras model's layers into stages.

A model can be split where exactly one tensor crosses from the layers before
to the layers after (a *cut point*). A Sequential model can be cut between any
two layers; a functional model with residual connections can only be cut
between its blocks. The layers between two consecutive cut points form a
`Block`, the unit the partitioner moves between stages.

Costs, per block and per example:

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

`plan_stages` then finds the contiguous split that minimises the cost of the
most expensive stage exactly (dynamic programming), and returns a `StagePlan`.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
from typing import Any, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import devices as devices_lib


class Criterion(str, enum.Enum):
  """What `plan_stages` balances."""
  BALANCED = "balanced"  # Mean of the normalised parameter and FLOP shares.
  PARAMS = "params"      # Parameter bytes (memory per device).
  FLOPS = "flops"        # Forward FLOPs (compute time per device).


# Slot variables per trainable weight kept by common optimizers.
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "rmsprop": 1, "adagrad": 1,
                   "adam": 2, "adamw": 2, "nadam": 2, "adamax": 2, "lion": 1}


# ----------------------------------------------------------------- graph


def _dtype_size(dtype: Any) -> int:
  return tf.as_dtype(keras.backend.standardize_dtype(dtype)).size


def _elements(shape: Sequence[int | None]) -> int:
  """Number of elements per example (batch axis dropped; unknown dims = 1)."""
  return math.prod(1 if d is None else int(d) for d in tuple(shape)[1:])


def tensor_bytes(tensor: keras.KerasTensor) -> int:
  """Bytes of one example of a symbolic tensor."""
  return _elements(tensor.shape) * _dtype_size(tensor.dtype)


def _producer(tensor: keras.KerasTensor):
  # Keras 3 has no public graph-walking API; `_keras_history` and
  # `_inbound_nodes` are what `keras.Model` itself uses to walk its graph.
  op, node_index, _ = tensor._keras_history  # pylint: disable=protected-access
  return op._inbound_nodes[node_index]  # pylint: disable=protected-access


class ModelGraph:
  """The nodes of a single-input, single-output Keras model in topological order.

  Attributes:
    model: the model.
    nodes: the layer calls (Keras `Node`s) in topological order, inputs
      excluded.
    names: the layer name of each node.
  """

  def __init__(self, model: keras.Model):
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
    self.model = model
    self.input = inputs[0]
    self.output = outputs[0]
    # Collect the nodes reachable backwards from the output.
    found, stack = {}, [self.output]
    while stack:
      node = _producer(stack.pop())
      if id(node) in found or node.operation is self.input._keras_history[0]:  # pylint: disable=protected-access
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
    # Kahn's algorithm, ties broken by the model's own layer order.
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
    self.nodes = []
    while ready:
      _, k = heapq.heappop(ready)
      self.nodes.append(found[k])
      for u in users[k]:
        missing[u] -= 1
        if missing[u] == 0:
          heapq.heappush(ready, (rank(u), u))
    self.names = [n.operation.name for n in self.nodes]
    self._position = {name: i for i, name in enumerate(self.names)}
    # Each tensor lives from its producer's position to its last consumer's.
    n = len(self.nodes)
    self._tensors = {id(self.input): [self.input, -1, -1]}
    for i, node in enumerate(self.nodes):
      for t in node.output_tensors:
        self._tensors[id(t)] = [t, i, i]
    for i, node in enumerate(self.nodes):
      for t in node.input_tensors:
        self._tensors[id(t)][2] = max(self._tensors[id(t)][2], i)
    self._tensors[id(self.output)][2] = n

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
    op = tensor._keras_history[0]  # pylint: disable=protected-access
    return f"output of {op.name!r} {tuple(tensor.shape)}"


# ----------------------------------------------------------------- costs


def param_bytes(layer: keras.layers.Layer, trainable_only: bool = False) -> int:
  """Bytes of a layer's weights (all of them, or only the trainable ones)."""
  # Bare ops (keras.ops.* in a functional model) have no weights.
  weights = (getattr(layer, "trainable_weights", []) if trainable_only
             else getattr(layer, "weights", []))
  return sum(math.prod(v.shape) * _dtype_size(v.dtype) for v in weights)


def _activation_flops(layer, out_elements: int) -> int:
  act = getattr(layer, "activation", None)
  name = getattr(act, "__name__", "linear")
  return 0 if act is None or name == "linear" else out_elements


def _spatial(shape) -> int:
  return math.prod(1 if d is None else int(d) for d in tuple(shape)[1:-1])


def node_flops(node) -> int:
  """Forward FLOPs per example of one layer call (see the module docstring)."""
  layer = node.operation
  ins, outs = node.input_tensors, node.output_tensors
  out_el = sum(_elements(t.shape) for t in outs)
  in_shape = tuple(ins[0].shape) if ins else ()
  out_shape = tuple(outs[0].shape)
  L = keras.layers
  if isinstance(layer, keras.Model):
    try:
      return sum(node_flops(n) for n in ModelGraph(layer).nodes)
    except (TypeError, ValueError):  # Subclassed or multi-input: estimate.
      return out_el
  if isinstance(layer, L.Dense):
    fan_in = int(in_shape[-1])
    positions = _spatial(in_shape)
    flops = 2 * positions * fan_in * layer.units
    flops += positions * layer.units if layer.use_bias else 0
    return flops + _activation_flops(layer, out_el)
  if isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
    cin = int(in_shape[-1])
    k = math.prod(layer.kernel_size)
    flops = 2 * _spatial(out_shape) * (k * cin * layer.depth_multiplier +
                                       cin * layer.depth_multiplier *
                                       layer.filters)
    return flops + _activation_flops(layer, out_el)
  if isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
    k = math.prod(layer.kernel_size)
    flops = 2 * _spatial(out_shape) * k * int(out_shape[-1])
    return flops + _activation_flops(layer, out_el)
  if isinstance(layer, (L.Conv1DTranspose, L.Conv2DTranspose,
                        L.Conv3DTranspose)):
    k = math.prod(layer.kernel_size)
    flops = 2 * _spatial(in_shape) * k * int(in_shape[-1]) * layer.filters
    flops += out_el if layer.use_bias else 0
    return flops + _activation_flops(layer, out_el)
  if isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)):
    k = math.prod(layer.kernel_size)
    cin = int(in_shape[-1]) // getattr(layer, "groups", 1)
    flops = 2 * _spatial(out_shape) * k * cin * layer.filters
    flops += out_el if layer.use_bias else 0
    return flops + _activation_flops(layer, out_el)
  if isinstance(layer, (L.BatchNormalization, L.LayerNormalization,
                        L.GroupNormalization, L.UnitNormalization)):
    return 5 * out_el
  if isinstance(layer, (L.GlobalAveragePooling1D, L.GlobalAveragePooling2D,
                        L.GlobalAveragePooling3D, L.GlobalMaxPooling1D,
                        L.GlobalMaxPooling2D, L.GlobalMaxPooling3D)):
    return _elements(in_shape)
  if hasattr(layer, "pool_size"):
    return math.prod(layer.pool_size) * out_el
  if isinstance(layer, (L.Add, L.Subtract, L.Multiply, L.Average, L.Maximum,
                        L.Minimum)):
    return max(len(ins) - 1, 1) * out_el
  if isinstance(layer, (L.Flatten, L.Reshape, L.Permute, L.Dropout,
                        L.Concatenate, L.InputLayer, L.Embedding,
                        L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D,
                        L.Cropping1D, L.Cropping2D, L.Cropping3D,
                        L.RepeatVector, L.Identity, L.SpatialDropout1D,
                        L.SpatialDropout2D, L.SpatialDropout3D,
                        L.GaussianNoise, L.GaussianDropout)):
    return 0
  return out_el


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


def model_blocks(model: keras.Model | ModelGraph) -> list[Block]:
  """Splits a model at its cut points and costs each block.

  Args:
    model: a built single-input, single-output Sequential or functional model
      (or its `ModelGraph`).

  Returns:
    The blocks in order; their layers cover the model's layers exactly once.
  """
  graph = model if isinstance(model, ModelGraph) else ModelGraph(model)
  starts = [0] + graph.cut_positions()
  ends = starts[1:] + [len(graph.nodes)]
  unknown = [t for t, _, _ in graph._tensors.values()  # pylint: disable=protected-access
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
        activation_bytes=sum(tensor_bytes(t) for n in nodes
                             for t in n.output_tensors),
        output_bytes=tensor_bytes(out),
        output_shape=tuple(out.shape)))
  return blocks


# ------------------------------------------------------------ partitioner


def min_max_partition(costs: Sequence[float], num_parts: int) -> list[int]:
  """Exact contiguous partition minimising the largest part's cost.

  Dynamic programming over (parts, prefix): O(num_parts * n^2). Among the
  optimal partitions it returns the one with the smallest sum of squared part
  costs (a second exact pass), so the other parts are even too.

  Args:
    costs: non-negative cost of each item, in order.
    num_parts: number of non-empty contiguous parts, `1 <= num_parts <= n`.

  Returns:
    The start index of each part (the first is 0).

  Raises:
    ValueError: `num_parts` outside `1..len(costs)` or a negative cost.
  """
  n = len(costs)
  if not 1 <= num_parts <= n:
    raise ValueError(f"num_parts={num_parts} must be between 1 and the "
                     f"number of items ({n}).")
  if any(c < 0 for c in costs):
    raise ValueError(f"costs must be non-negative; got {list(costs)}.")
  prefix = [0.0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  inf = float("inf")

  def solve(score, combine, allowed):
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    arg = [[-1] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for m in range(1, num_parts + 1):
      for j in range(m, n - num_parts + m + 1):
        for i in range(m - 1, j):
          part = prefix[j] - prefix[i]
          if best[m - 1][i] == inf or not allowed(part):
            continue
          value = combine(best[m - 1][i], score(part))
          if value < best[m][j]:
            best[m][j], arg[m][j] = value, i
    starts, j = [], n
    for m in range(num_parts, 0, -1):
      j = arg[m][j]
      starts.append(j)
    return best[num_parts][n], starts[::-1]

  optimum, _ = solve(lambda p: p, max, lambda p: True)
  bound = optimum + 1e-12 * max(1.0, abs(optimum))
  _, starts = solve(lambda p: p * p, lambda a, b: a + b,
                    lambda p: p <= bound)
  return starts


# -------------------------------------------------------------- the plan


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def _fmt_count(n: float) -> str:
  for unit in ("", "K", "M", "G"):
    if abs(n) < 1000 or unit == "G":
      return f"{n:.0f}" if not unit else f"{n:.1f}{unit}"
    n /= 1000
  return str(n)


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a `StagePlan`; byte and FLOP counts are per example.

  Attributes:
    index: position of the stage, from 0.
    device: the device that holds its weights and runs it.
    layers: its layer names, in topological order.
    param_bytes: bytes of all its weights.
    trainable_param_bytes: bytes of its trainable weights.
    flops: forward FLOPs per example.
    activation_bytes: bytes of its layers' outputs per example (kept for
      the backward pass).
    input_bytes: bytes of the tensor it receives per example.
    sent_bytes: bytes it sends to the next stage per example (and receives
      back as a gradient); 0 for the last stage.
  """
  index: int
  device: str
  layers: tuple[str, ...]
  param_bytes: int
  trainable_param_bytes: int
  flops: int
  activation_bytes: int
  input_bytes: int
  sent_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Estimated bytes one device holds while training (see `memory_estimate`)."""
  device: str
  weights: int
  gradients: int
  optimizer_slots: int
  activations: int

  @property
  def total(self) -> int:
    return self.weights + self.gradients + self.optimizer_slots + self.activations


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """Which layers go to which device, with their costs. Print it for a table.

  Attributes:
    stages: the stages in order.
    criterion: what the split balanced (`"balanced"`, `"params"`, `"flops"`,
      or `"split_points"` when the split was given).
    model_name: the model the plan was made for.
  """
  stages: tuple[Stage, ...]
  criterion: str
  model_name: str = ""

  def __post_init__(self):
    if not self.stages:
      raise ValueError("StagePlan needs at least one stage.")
    seen: set[str] = set()
    for i, stage in enumerate(self.stages):
      if stage.index != i:
        raise ValueError(f"stage at position {i} has index={stage.index}; "
                         "indices must be 0, 1, 2, ... in order.")
      if not stage.layers:
        raise ValueError(f"stage {i} has no layers; every stage needs one.")
      dup = seen.intersection(stage.layers)
      if dup:
        raise ValueError(f"layers {sorted(dup)} appear in two stages.")
      seen.update(stage.layers)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def devices(self) -> tuple[str, ...]:
    return tuple(s.device for s in self.stages)

  @property
  def layer_names(self) -> tuple[str, ...]:
    return tuple(name for s in self.stages for name in s.layers)

  def stage_of(self, layer_name: str) -> int:
    """The index of the stage holding `layer_name`."""
    for s in self.stages:
      if layer_name in s.layers:
        return s.index
    raise ValueError(f"layer_name={layer_name!r} is in no stage of this plan. "
                     f"Layers: {', '.join(self.layer_names)}.")

  def memory_estimate(self, batch_size: int, *,
                      optimizer: str | int = "adam") -> dict[str, MemoryEstimate]:
    """Estimates the training memory of each device.

    Per stage: its weights; one gradient per trainable weight; the optimizer's
    slots (`optimizer` names one of `OPTIMIZER_SLOTS` or gives the number of
    slots per weight); and `batch_size` times the activations kept for the
    backward pass (its input and every layer output). Stages sharing a device
    add up. Framework workspace and fragmentation are not counted.

    Args:
      batch_size: examples per step on each stage.
      optimizer: optimizer name or slots per trainable weight. Defaults to
        `"adam"` (2 slots).

    Returns:
      `{device: MemoryEstimate}` in stage order.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size={batch_size!r} must be a positive int.")
    if isinstance(optimizer, str):
      if optimizer.lower() not in OPTIMIZER_SLOTS:
        raise ValueError(
            f"optimizer={optimizer!r} is unknown; use one of "
            f"{', '.join(OPTIMIZER_SLOTS)} or the number of slots per weight.")
      slots = OPTIMIZER_SLOTS[optimizer.lower()]
    else:
      slots = int(optimizer)
    out: dict[str, MemoryEstimate] = {}
    for s in self.stages:
      prev = out.get(s.device, MemoryEstimate(s.device, 0, 0, 0, 0))
      out[s.device] = MemoryEstimate(
          s.device,
          prev.weights + s.param_bytes,
          prev.gradients + s.trainable_param_bytes,
          prev.optimizer_slots + slots * s.trainable_param_bytes,
          prev.activations + batch_size * (s.input_bytes + s.activation_bytes))
    return out

  def table(self) -> str:
    """A plain-text table: one row per stage, then the totals."""
    header = ("stage", "device", "layers", "params", "FLOPs/ex", "sends/ex")
    rows = []
    for s in self.stages:
      names = (s.layers[0] if len(s.layers) == 1 else
               f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})")
      rows.append((str(s.index), s.device, names, _fmt_bytes(s.param_bytes),
                   _fmt_count(s.flops),
                   _fmt_bytes(s.sent_bytes) if s.sent_bytes else "-"))
    rows.append(("total", "", f"{len(self.layer_names)} layers",
                 _fmt_bytes(sum(s.param_bytes for s in self.stages)),
                 _fmt_count(sum(s.flops for s in self.stages)),
                 _fmt_bytes(sum(s.sent_bytes for s in self.stages))))
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(6)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    title = (f"StagePlan for {self.model_name!r}: {self.num_stages} stage(s), "
             f"criterion={self.criterion}")
    return "\n".join([title, line(header)] + [line(r) for r in rows])

  def __str__(self) -> str:
    return self.table()


def _block_costs(blocks: Sequence[Block], criterion: Criterion) -> list[float]:
  params = [b.param_bytes for b in blocks]
  flops = [b.flops for b in blocks]
  if criterion is Criterion.PARAMS:
    return [float(p) for p in params]
  if criterion is Criterion.FLOPS:
    return [float(f) for f in flops]
  # Balanced: each block's share of the total parameters and of the total
  # FLOPs, averaged (a metric with a zero total drops out).
  shares = [[v / sum(vals) for v in vals] for vals in (params, flops)
            if sum(vals) > 0]
  if not shares:
    return [1.0] * len(blocks)
  return [sum(s[i] for s in shares) / len(shares) for i in range(len(blocks))]


def _choose_devices(num_stages: int, devices: Sequence[str] | None) -> list[str]:
  if devices is None:
    found = devices_lib.accelerator_devices()
    if num_stages > len(found):
      raise ValueError(
          f"num_stages={num_stages} but only {len(found)} device(s) exist: "
          f"{', '.join(found)}. Use num_stages<={len(found)}, pass devices=[...] "
          "(one device may hold several stages), or split a device with "
          "tfmgpu.configure_devices(logical_cpus=N) (CLI: --virtual_devices=N).")
    return found[:num_stages]
  devices = list(devices)
  if len(devices) != num_stages:
    raise ValueError(
        f"devices={devices} names {len(devices)} device(s) for num_stages="
        f"{num_stages}; give exactly one device per stage (repeat a device to "
        "put several stages on it).")
  return devices_lib.resolve_devices(devices)


def _split_starts(graph: ModelGraph, blocks: Sequence[Block],
                  split_points: Sequence[str], num_stages: int) -> list[int]:
  """Block indices where stages start, from layer names."""
  if len(split_points) != num_stages - 1:
    raise ValueError(
        f"split_points={list(split_points)} has {len(split_points)} name(s) "
        f"but num_stages={num_stages} needs {num_stages - 1}: each split point "
        "is the first layer of a new stage.")
  first_layers = {b.layers[0]: i for i, b in enumerate(blocks)}
  valid = [b.layers[0] for b in blocks[1:]]
  starts = [0]
  for name in split_points:
    try:
      pos = graph.position(name)
    except KeyError:
      raise ValueError(
          f"split point {name!r} is not a layer of model {graph.model.name!r}. "
          f"Valid split points: {', '.join(valid) or 'none'}.") from None
    if name not in first_layers or first_layers[name] == 0:
      if pos == 0:
        raise ValueError(
            f"split point {name!r} is the model's first layer: a stage "
            f"would be empty. Valid split points: {', '.join(valid)}.")
      crossing = graph.crossing(pos)
      raise ValueError(
          f"split point {name!r} cannot start a stage: cutting before it "
          f"leaves {len(crossing)} tensors crossing the cut "
          f"({'; '.join(graph.describe(t) for t in crossing)}), as inside a "
          "residual block; a stage boundary needs exactly one. Valid split "
          f"points: {', '.join(valid) or 'none'}.")
    starts.append(first_layers[name])
  if starts != sorted(set(starts)):
    raise ValueError(
        f"split_points={list(split_points)} must be distinct and in the "
        f"model's layer order ({', '.join(valid)}).")
  return starts


def plan_stages(model: keras.Model, num_stages: int, *,
                criterion: str = "balanced",
                split_points: Sequence[str] | None = None,
                devices: Sequence[str] | None = None) -> StagePlan:
  """Splits a model into `num_stages` contiguous stages, one per device.

  Args:
    model: a built single-input, single-output Sequential or functional model.
    num_stages: number of stages.
    criterion: what to balance when `split_points` is not given: `"params"`
      (parameter bytes), `"flops"` (forward FLOPs per example) or
      `"balanced"` (each block's share of total params plus its share of
      total FLOPs, halved). The split minimises the largest stage's cost
      exactly. Defaults to `"balanced"`.
    split_points: names of the layers that *start* stages 1..K-1, instead
      of balancing.
    devices: one device per stage. Defaults to the first `num_stages`
      accelerators (GPUs, else logical CPUs).

  Returns:
    The `StagePlan`.

  Raises:
    ValueError: more stages than cuttable blocks or than devices, an unknown
      criterion or device, an unknown split point or one where the model
      cannot be cut into a chain.
  """
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages={num_stages!r} must be a positive int.")
  try:
    crit = Criterion(criterion)
  except ValueError:
    raise ValueError(f"criterion={criterion!r} is unknown; choose one of "
                     f"{', '.join(c.value for c in Criterion)}.") from None
  graph = ModelGraph(model)
  blocks = model_blocks(graph)
  if num_stages > len(blocks):
    raise ValueError(
        f"num_stages={num_stages} but model {model.name!r} has only "
        f"{len(blocks)} cuttable block(s) (layers between valid cut points; "
        "residual blocks cannot be cut inside). Use num_stages<="
        f"{len(blocks)}.")
  chosen = _choose_devices(num_stages, devices)
  if split_points is not None:
    starts = _split_starts(graph, blocks, split_points, num_stages)
    label = "split_points"
  else:
    starts = min_max_partition(_block_costs(blocks, crit), num_stages)
    label = crit.value
  ends = starts[1:] + [len(blocks)]
  stages = []
  input_bytes = tensor_bytes(graph.input)
  for k, (a, b) in enumerate(zip(starts, ends)):
    part = blocks[a:b]
    stages.append(Stage(
        index=k, device=chosen[k],
        layers=tuple(n for blk in part for n in blk.layers),
        param_bytes=sum(blk.param_bytes for blk in part),
        trainable_param_bytes=sum(blk.trainable_param_bytes for blk in part),
        flops=sum(blk.flops for blk in part),
        activation_bytes=sum(blk.activation_bytes for blk in part),
        input_bytes=input_bytes,
        sent_bytes=part[-1].output_bytes if k < num_stages - 1 else 0))
    input_bytes = part[-1].output_bytes
  return StagePlan(tuple(stages), label, model.name)
