"""Picks a layout to generate text with: `plan_serving` (latency or
throughput).

A decode step reads one token per request row through every layer. Each
layout `R` data copies x `K` stages x `T` tensor shards (the ones
`tfmgpu.generation` runs) is costed from `tfmgpu.parallel.accounting`:

* memory per device: the weights it holds plus its KV cache
  (`tfmgpu.parallel.kv_cache`) for its copy's `ceil(rows / R)` rows of
  `context` positions; no gradients, no optimizer slots;
* one decode step for `r` rows of a copy: stage `k` computes its forward
  FLOPs per token (the accounting's per-example FLOPs over the model's
  input width; split layers divided by `T`) for `r` rows at the device's
  FLOP/s, plus its tensor all-reduces (ring over `T`) and a fixed task
  overhead; rows pass the stages one after another (each cut's transfer
  added), or, in `K` row groups, overlap so that the slowest stage
  serves every group in turn; the cheaper of the two is the step;
* goal `latency`: the shortest step for `batch` rows; goal `throughput`:
  the most tokens/s with as many rows, up to `batch`, as the memory
  holds.

Predictions of a cost model, not measurements: attention's cost growing
with the context, kernel efficiency and framework overheads are not
modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from tfmgpu.parallel import accounting
from tfmgpu.parallel import kv_cache
from tfmgpu.parallel import layout as layout_lib
from tfmgpu.parallel import plan as plan_lib

GOALS = ("latency", "throughput")


@dataclasses.dataclass(frozen=True)
class ServeCandidate:
  """One layout weighed for generation.

  Attributes:
    data, stages, tensor: `R`, `K`, `T`.
    rows: request rows it serves at once (all copies).
    step_s: predicted time of one decode step (each row one token).
    memory_bytes: weights + KV cache of its largest device.
    fits: `memory_bytes` is within the budget.
  """
  data: int
  stages: int
  tensor: int
  rows: int
  step_s: float
  memory_bytes: int
  fits: bool

  @property
  def tokens_per_s(self) -> float:
    return self.rows / self.step_s

  @property
  def label(self) -> str:
    parts = [f"{n} {v}" for n, v in (("data", self.data), ("pipeline",
             self.stages), ("tensor", self.tensor)) if v > 1]
    return " x ".join(parts) or "one device"


def _step_s(acc: accounting.LayoutAccount, hw: accounting.Hardware,
            rows: int, width: int) -> float:
  """One decode step for `rows` rows of one copy (module docstring)."""
  T, K = acc.tensor, acc.stages
  _, t_bw = hw.link_for(T)
  _, p_bw = hw.link_for(K * T)

  def stage(k: int, r: float) -> float:
    reduce = 2 * (T - 1) / T * acc.reduce_bytes[k][0] * r / width  # Ring.
    return (acc.stage_flops[k] * r / width / hw.flops_per_s
            + reduce / t_bw + hw.task_overhead_s)

  transfer = lambda r: sum(acc.cut_bytes[:-1]) * r / width / p_bw
  one_by_one = sum(stage(k, rows) for k in range(K)) + transfer(rows)
  group = rows / K
  overlapped = K * max(stage(k, group) for k in range(K)) + transfer(group)
  return min(one_by_one, overlapped) if K > 1 else one_by_one


def _weigh(model: Any, hw: accounting.Hardware, layout: layout_lib.Layout,
           rows: int, context: int, width: int, rules: Any) -> ServeCandidate:
  acc = accounting.account(model, layout, global_batch_size=layout.data,
                           rules=rules, devices=hw.devices(
                               layout.stages * layout.tensor))
  cache = kv_cache.per_device(model, layout, batch=rows, context=context,
                              rules=rules,
                              devices=[d.device for d in acc.devices])
  memory = max(d.memory.weights + cache[d.device] for d in acc.devices)
  step = _step_s(acc, hw, math.ceil(rows / layout.data), width)
  return ServeCandidate(layout.data, layout.stages, layout.tensor, rows,
                        step, int(memory), memory <= hw.memory_bytes)


def _layouts(model: Any, hw: accounting.Hardware, rules: Any):
  """Every `(R, K, T)` that fits the devices and the model's splits (at
  most one attention block per stage)."""
  split = accounting.tensor_split(model, rules)
  blocks = len(kv_cache.cache_layers(model, rules))  # A block per stage.
  for t in range(1, hw.num_devices + 1):
    if t > 1 and (split.why_not(t) or t > (hw.devices_per_host or t)):
      continue
    for k in range(1, min(blocks, hw.num_devices // t) + 1):
      for r in range(1, hw.num_devices // (t * k) + 1):
        yield layout_lib.Layout(r, k, t)


def weigh_serving(model: Any, hardware: accounting.Hardware, *, batch: int,
                  context: int, goal: str = "latency",
                  rules: Mapping[str, str] | None = None
                  ) -> list[ServeCandidate]:
  """Every layout weighed for `goal`, best first (those that fit first).

  Args:
    model: the unsplit `gpt` (built; its input width is `W`).
    hardware: the devices (`accounting.Hardware`, e.g. `host_hardware`).
    batch: request rows (`throughput`: at most this many).
    context: positions per row (prompt + new tokens).
    goal: `"latency"` (shortest step for `batch` rows) or `"throughput"`
      (most tokens/s).
    rules: the tensor rules (`TENSOR_RULES_GPT` by default).

  Raises:
    ValueError: an unknown goal.
  """
  if goal not in GOALS:
    raise ValueError(f"goal={goal!r} is unknown; choose one of "
                     f"{', '.join(GOALS)}.")
  width = int(model.inputs[0].shape[1])
  out = []
  for layout in _layouts(model, hardware, rules):
    best = _weigh(model, hardware, layout, batch, context, width, rules)
    rows = batch
    while goal == "throughput" and not best.fits and rows > layout.data:
      rows //= 2  # The most rows whose cache fits, by halving.
      best = _weigh(model, hardware, layout, rows, context, width, rules)
    out.append(best)
  key = ((lambda c: c.step_s) if goal == "latency"
         else (lambda c: -c.tokens_per_s))
  return sorted(out, key=lambda c: (not c.fits, key(c), c.memory_bytes,
                                    c.data * c.stages * c.tensor))


def plan_serving(model: Any, hardware: accounting.Hardware, *, batch: int,
                 context: int, goal: str = "latency",
                 rules: Mapping[str, str] | None = None) -> ServeCandidate:
  """The best layout that fits (see `weigh_serving`).

  Raises:
    ValueError: an unknown goal, or no layout fits the memory (naming the
      smallest estimate).
  """
  weighed = weigh_serving(model, hardware, batch=batch, context=context,
                          goal=goal, rules=rules)
  if not weighed[0].fits:
    least = min(weighed, key=lambda c: c.memory_bytes)
    raise ValueError(
        f"no layout of {hardware.num_devices} device(s) holds the weights "
        f"and KV cache of {batch} row(s) x {context} positions within "
        f"{plan_lib._fmt_bytes(hardware.memory_bytes)} per device: the "  # pylint: disable=protected-access
        f"smallest, {least.label}, needs "
        f"{plan_lib._fmt_bytes(least.memory_bytes)}. Use fewer rows, a "  # pylint: disable=protected-access
        "shorter context or more devices.")
  return weighed[0]


def format_serving(weighed: list[ServeCandidate], hardware: accounting.Hardware,
                   *, goal: str, context: int, shown: int = 8) -> str:
  """The best `shown` layouts weighed and the choice, as text."""
  fmt = plan_lib._fmt_bytes  # pylint: disable=protected-access
  header = ("layout", "rows", "step (predicted)", "tokens/s",
            "memory/device", "fits")
  rows = [(c.label, str(c.rows), f"{c.step_s * 1e3:.3f} ms",
           f"{c.tokens_per_s:,.0f}", fmt(c.memory_bytes),
           "yes" if c.fits else "no") for c in weighed[:shown]]
  widths = [max(len(r[i]) for r in [header] + rows)
            for i in range(len(header))]
  line = lambda r: "  ".join([r[0].ljust(widths[0])] + [
      v.rjust(w) for v, w in zip(r[1:], widths[1:])])
  title = (f"Serving plan ({goal}): {len(weighed)} layouts of "
           f"{hardware.num_devices} {hardware.device_kind} device(s), "
           f"{fmt(hardware.memory_bytes)} each, {context} positions per "
           "row; weights + KV cache, decode steps predicted by the cost "
           "model, not measured.")
  chosen = next((c for c in weighed if c.fits), None)
  last = (f"chosen: {chosen.label} ({chosen.rows} rows at once)."
          if chosen else "no layout fits.")
  return "\n".join([title, line(header)] + [line(r) for r in rows] + [last])
