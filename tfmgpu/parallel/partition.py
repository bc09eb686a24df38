"""The partitioner: an exact, balanced split of a model's blocks into stages.

`plan_stages` costs a model's blocks (`tfmgpu.parallel.cost`), finds the
contiguous split into stages that minimises the cost of the most expensive
stage exactly (`min_max_partition`, dynamic programming), or follows the
split points it is given, assigns one device per stage, and returns a
`StagePlan` (`tfmgpu.parallel.plan`).
"""

from __future__ import annotations

from typing import Sequence

import keras

from tfmgpu import devices as devices_lib
from tfmgpu.parallel import choices
from tfmgpu.parallel import cost as cost_lib
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import plan as plan_lib


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


def _split_starts(graph: graph_lib.ModelGraph,
                  blocks: Sequence[cost_lib.Block],
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



def _criterion(criterion: str) -> cost_lib.Criterion:
  if criterion not in choices.PARTITION_CHOICES:
    raise ValueError(
        f"criterion={criterion!r} is unknown; choose one of "
        f"{', '.join(choices.PARTITION_CHOICES)}.")
  return cost_lib.Criterion(criterion)


def _stages(blocks: Sequence[cost_lib.Block], starts: Sequence[int],
            devices: Sequence[str], input_bytes: int) -> tuple[plan_lib.Stage, ...]:
  """One `Stage` per run of blocks from `starts[k]`, on `devices[k]`."""
  ends = list(starts[1:]) + [len(blocks)]
  stages = []
  for k, (a, b) in enumerate(zip(starts, ends)):
    part = blocks[a:b]
    stages.append(plan_lib.Stage(
        index=k, device=devices[k],
        layers=tuple(n for blk in part for n in blk.layers),
        param_bytes=sum(blk.param_bytes for blk in part),
        trainable_param_bytes=sum(blk.trainable_param_bytes for blk in part),
        flops=sum(blk.flops for blk in part),
        activation_bytes=sum(blk.activation_bytes for blk in part),
        input_bytes=input_bytes,
        sent_bytes=part[-1].output_bytes if k < len(starts) - 1 else 0))
    input_bytes = part[-1].output_bytes
  return tuple(stages)


def plan_stages(model: keras.Model, num_stages: int, *,
                criterion: str = "balanced",
                split_points: Sequence[str] | None = None,
                devices: Sequence[str] | None = None) -> plan_lib.StagePlan:
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
  crit = _criterion(criterion)
  graph = graph_lib.ModelGraph(model)
  blocks = cost_lib.model_blocks(graph)
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
    starts = min_max_partition(cost_lib.block_costs(blocks, crit), num_stages)
    label = crit.value
  stages = _stages(blocks, starts, chosen, graph_lib.tensor_bytes(graph.input))
  return plan_lib.StagePlan(stages, label, model.name)
