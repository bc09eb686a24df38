"""The partitioner: an exact, balanced split of a model's blocks into stages.

`plan_stages` costs a model's layer calls and the bytes crossing each cut
(`tfmgpu.parallel.cost`), finds the contiguous split into stages that
minimises the cost of the most expensive stage exactly (`min_max_partition`,
dynamic programming; a stage's cost is its layers' cost plus the cost of the
cuts it receives and sends across), or follows the split points it is given,
assigns one device per stage, and returns a `StagePlan`
(`tfmgpu.parallel.plan`). A cut may fall before any layer: every tensor that
crosses it (activations, skip tensors, model inputs read later) travels to
the next stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras

from tfmgpu import _compat
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import choices
from tfmgpu.parallel import cost as cost_lib
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import shared


def min_max_partition(costs: Sequence[float], num_parts: int,
                      cut_costs: Sequence[float] | None = None) -> list[int]:
  """Exact contiguous partition minimising the largest part's cost.

  A part `items[i:j]` costs `sum(costs[i:j])` plus the cost of the cuts at
  its ends (`cut_costs[i - 1]` if `i > 0`, `cut_costs[j - 1]` if `j < n`).
  Dynamic programming over (parts, prefix): O(num_parts * n^2). Among the
  optimal partitions it returns the one with the smallest sum of squared part
  costs (a second exact pass), so the other parts are even too.

  Args:
    costs: non-negative cost of each item, in order.
    num_parts: number of non-empty contiguous parts, `1 <= num_parts <= n`.
    cut_costs: non-negative cost of cutting before item `i` at index
      `i - 1` (`n - 1` entries). Defaults to free cuts.

  Returns:
    The start index of each part (the first is 0).

  Raises:
    ValueError: `num_parts` outside `1..len(costs)`, a negative cost, or
      `cut_costs` of the wrong length.
  """
  n = len(costs)
  if not 1 <= num_parts <= n:
    raise ValueError(f"num_parts={num_parts} must be between 1 and the "
                     f"number of items ({n}).")
  cuts = [0.0] * max(n - 1, 0) if cut_costs is None else list(cut_costs)
  if len(cuts) != max(n - 1, 0):
    raise ValueError(f"cut_costs has {len(cuts)} entries; {n} items need "
                     f"{max(n - 1, 0)} (one per place between two items).")
  if any(c < 0 for c in list(costs) + cuts):
    raise ValueError(f"costs must be non-negative; got {list(costs)} and "
                     f"cut_costs {cuts}.")
  prefix = [0.0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  edge = [0.0] + cuts + [0.0]  # edge[p]: the cut before item p.
  part_cost = lambda i, j: prefix[j] - prefix[i] + edge[i] + edge[j]
  optimum, _ = _solve(n, num_parts, part_cost, lambda p: p, max,
                      lambda p: True)
  bound = optimum + 1e-12 * max(1.0, abs(optimum))
  _, starts = _solve(n, num_parts, part_cost, lambda p: p * p,
                     lambda a, b: a + b, lambda p: p <= bound)
  return starts


def _solve(n: int, num_parts: int, part_cost, score, combine, allowed):
  """`(best value, part starts)` over contiguous splits of `n` items:
  `combine` of `score(part_cost(i, j))` over parts, only `allowed` parts."""
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
  arg = [[-1] * (n + 1) for _ in range(num_parts + 1)]
  best[0][0] = 0.0
  for m in range(1, num_parts + 1):
    for j in range(m, n - num_parts + m + 1):
      for i in range(m - 1, j):
        if best[m - 1][i] == inf:
          continue
        part = part_cost(i, j)
        if not allowed(part):
          continue
        value = combine(best[m - 1][i], score(part))
        if value < best[m][j]:
          best[m][j], arg[m][j] = value, i
  starts, j = [], n
  for m in range(num_parts, 0, -1):
    j = arg[m][j]
    starts.append(j)
  return best[num_parts][n], starts[::-1]


def _choose_devices(num_stages: int, devices: Sequence[str] | None,
                    check: bool = True) -> list[str]:
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
  if not check:  # A plan for another machine: names only.
    return [devices_lib.canonical_device(d) for d in devices]
  return devices_lib.resolve_devices(devices)


def _valid_names(blocks: Sequence[cost_lib.Block]) -> str:
  """The layers that can start a stage, for error messages (abridged)."""
  names = [b.layers[0] for b in blocks[1:]]
  if len(names) > 12:
    names = names[:6] + [f"... ({len(names) - 12} more) ..."] + names[-6:]
  return ", ".join(names) or "none"


def _kept_whole(graph: graph_lib.ModelGraph, name: str) -> str:
  """Where a layer `name` sits inside a layer the split keeps whole (a
  nested Sequential or subclassed model), said for an error ("is inside
  ..."); else `""`."""
  for layer in graph.layers().values():
    inner = [l.name for l in _compat.flatten_layers(layer)
             if l is not layer]
    if name in inner:
      return (f"is inside {layer.name!r} ({type(layer).__name__}) of "
              f"model {graph.model.name!r}, which a split keeps whole (only "
              "nested functional models are opened). Split before or after "
              f"{layer.name!r}, or build {layer.name!r} as a functional "
              "model to cut inside it")
  return ""


def _split_starts(graph: graph_lib.ModelGraph,
                  blocks: Sequence[cost_lib.Block],
                  split_points: Sequence[str], num_stages: int) -> list[int]:
  """Block indices where stages start, from layer names."""
  if len(split_points) != num_stages - 1:
    raise ValueError(
        f"split_points={list(split_points)} has {len(split_points)} name(s) "
        f"but num_stages={num_stages} needs {num_stages - 1}: each split point "
        "is the first layer of a new stage.")
  valid = _valid_names(blocks)
  starts = [0]
  for name in split_points:
    try:
      pos = graph.position(name)
    except KeyError:
      where = _kept_whole(graph, name) or (
          f"is not a layer of model {graph.model.name!r}")
      raise ValueError(f"split point {name!r} {where}. Valid split points: "
                       f"{valid}.") from None
    if pos == 0:
      raise ValueError(
          f"split point {name!r} is the model's first layer: a stage "
          f"would be empty. Valid split points: {valid}.")
    starts.append(pos)
  if starts != sorted(set(starts)):
    raise ValueError(
        f"split_points={list(split_points)} must be distinct and in the "
        f"model's layer order ({valid}).")
  return starts


def _criterion(criterion: str) -> cost_lib.Criterion:
  if criterion not in choices.PARTITION_CHOICES:
    raise ValueError(
        f"criterion={criterion!r} is unknown; choose one of "
        f"{', '.join(choices.PARTITION_CHOICES)}.")
  return cost_lib.Criterion(criterion)


def _once_per_stage(graph: graph_lib.ModelGraph,
                    blocks: Sequence[cost_lib.Block], a: int, b: int
                    ) -> list[cost_lib.Block]:
  """Blocks `a:b`, a layer's later calls in the same stage holding no
  weights of their own (a tied LM head beside its embedding)."""
  seen: set[int] = set()
  out = []
  for i in range(a, b):
    layer = id(graph.nodes[i].operation)
    out.append(blocks[i] if layer not in seen else dataclasses.replace(
        blocks[i], param_bytes=0, trainable_param_bytes=0))
    seen.add(layer)
  return out


def _stages(graph: graph_lib.ModelGraph, blocks: Sequence[cost_lib.Block],
            starts: Sequence[int], devices: Sequence[str]
            ) -> tuple[plan_lib.Stage, ...]:
  """One `Stage` per run of blocks from `starts[k]`, on `devices[k]`."""
  ends = list(starts[1:]) + [len(blocks)]
  stages = []
  for k, (a, b) in enumerate(zip(starts, ends)):
    part = _once_per_stage(graph, blocks, a, b)
    last = k == len(starts) - 1
    sent = [] if last else graph.crossing(b)
    stages.append(plan_lib.Stage(
        index=k, device=devices[k],
        layers=tuple(n for blk in blocks[a:b] for n in blk.layers),
        param_bytes=sum(blk.param_bytes for blk in part),
        trainable_param_bytes=sum(blk.trainable_param_bytes for blk in part),
        flops=sum(blk.flops for blk in part),
        activation_bytes=sum(blk.activation_bytes for blk in part),
        input_bytes=graph.crossing_bytes(a),
        sent_bytes=sum(graph.tensor_bytes(t) for t in sent),
        sent=tuple(graph.name_of(t) for t in sent)))
  return tuple(stages)


def _plan(graph: graph_lib.ModelGraph, stages: tuple[plan_lib.Stage, ...],
          label: str) -> plan_lib.StagePlan:
  """The plan of `stages`, naming the weights shared between them."""
  unknown = graph.unknown()
  return plan_lib.StagePlan(
      stages, label, graph.model.name,
      shared=shared.between_stages(graph, stages),
      unknown_length=graph.describe(unknown[0]) if unknown else None)


def plan_stages(model: keras.Model, num_stages: int, *,
                criterion: str = "balanced",
                split_points: Sequence[str] | None = None,
                devices: Sequence[str] | None = None,
                transfer_weight: float = cost_lib.TRANSFER_WEIGHT,
                check_devices: bool = True,
                input_shape: Any = None) -> plan_lib.StagePlan:
  """Splits a model into `num_stages` contiguous stages, one per device.

  A stage may start at any layer: every tensor made before it and read
  after it (activations, skip tensors, model inputs such as a mask) is sent
  across, and the plan lists them with their bytes.

  Args:
    model: a built Sequential or functional model (several inputs and
      outputs allowed).
    num_stages: number of stages.
    criterion: what to balance when `split_points` is not given: `"params"`
      (parameter bytes), `"flops"` (forward FLOPs per example) or
      `"balanced"` (each layer's share of total params plus its share of
      total FLOPs, halved). A stage's cost adds the cost of the bytes it
      receives and sends (`transfer_weight`). The split minimises the
      largest stage's cost exactly. Defaults to `"balanced"`.
    split_points: names of the layers that *start* stages 1..K-1, instead
      of balancing.
    devices: one device per stage. Defaults to the first `num_stages`
      accelerators (GPUs, else logical CPUs).
    transfer_weight: what a byte crossing a cut costs, relative to what
      the model's layers cost on average per byte of output
      (`tfmgpu.parallel.cost.cut_costs`); 0 balances the layers alone.
    check_devices: `devices` must exist here; `False` plans for another
      machine (`--plan_only` for 8 GPUs on a laptop).
    input_shape: the data's shape per input (no batch axis), for inputs of
      unknown length (`tfmgpu.parallel.graph.ModelGraph`).

  Returns:
    The `StagePlan` (naming the weights shared between stages).

  Raises:
    ValueError: more stages than layers or than devices, an unknown
      criterion or device, or an unknown or misplaced split point.
  """
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages={num_stages!r} must be a positive int.")
  crit = _criterion(criterion)
  graph = graph_lib.ModelGraph(model, input_shape=input_shape)
  blocks = cost_lib.model_blocks(graph)
  if num_stages > len(blocks):
    raise ValueError(
        f"num_stages={num_stages} but model {model.name!r} has only "
        f"{len(blocks)} cuttable block(s) (one per layer call; a stage "
        f"needs at least one). Use num_stages<={len(blocks)}.")
  chosen = _choose_devices(num_stages, devices, check_devices)
  label = "split_points" if split_points is not None else crit.value
  starts = (_split_starts(graph, blocks, split_points, num_stages)
            if split_points is not None else _balanced_starts(
                graph, blocks, crit, num_stages, transfer_weight))
  return _plan(graph, _stages(graph, blocks, starts, chosen), label)


def _balanced_starts(graph: graph_lib.ModelGraph,
                     blocks: Sequence[cost_lib.Block],
                     crit: cost_lib.Criterion, num_stages: int,
                     transfer_weight: float) -> list[int]:
  """The first block of each stage, minimising the largest stage's cost."""
  costs = cost_lib.block_costs(blocks, crit)
  cuts = cost_lib.cut_costs(blocks, costs, cost_lib.cut_bytes(graph),
                            transfer_weight)
  return min_max_partition(costs, num_stages, cuts)
