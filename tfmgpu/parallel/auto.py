"""Picks a layout for a model and devices from the cost model: `plan_layout`.

The layouts weighed are the ones tfmgpu builds: data parallelism
(`mirrored` over n of the devices), model parallelism (`model_parallel`
over K stages) and pipelines (`pipeline` over K stages, M micro-batches,
GPipe or 1F1B, with or without recomputation). For each, from the model's
costs (`tfmgpu.parallel.cost`, per stage as `plan_stages` cuts it):

* memory per device: `StagePlan.memory_estimate` (data parallelism: the
  whole model as one stage, on `batch / n` examples), the largest device's;
* predicted step time, assuming every device computes at `flops_per_s`
  (a backward costs `BACKWARD_FACTOR` forwards; recomputation adds one
  forward; each forward and backward a device runs adds a fixed
  `task_overhead_s`) and each link moves `link_bytes_per_s`:
  - data parallel: the compute of `batch / n` examples, then a ring
    all-reduce of the gradients, `2 (n - 1) / n * gradient bytes / bandwidth`
    (no overlap with the backward);
  - stages: `tfmgpu.parallel.timeline.simulate` of the schedule with each
    stage's forward and backward time per micro-batch, and the largest
    cut's bytes per micro-batch / bandwidth as every transfer's delay
    (model parallelism: one micro-batch).

The fastest layout whose estimate fits `memory_bytes` wins (ties: less
memory, then the simpler layout); none that does not fit is ever chosen.
These are predictions of a cost model, not measurements: framework
workspace, kernel efficiency, and logical CPUs sharing one host's cores are
not modelled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from tfmgpu.parallel import plan as plan_lib

# Backward FLOPs per forward FLOP (gradients of inputs and of weights).
BACKWARD_FACTOR = 2.0
# Micro-batch counts weighed for a pipeline (those the batch divides).
MICRO_BATCHES = (2, 4, 8, 16, 32)
SCHEDULES = ("gpipe", "1f1b")
# Simpler first: the tie-break between equally fast, equally large layouts.
_SIMPLICITY = {"mirrored": 0, "model_parallel": 1, "pipeline": 2}


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The devices a layout is planned for.

  Attributes:
    num_devices: how many devices.
    device_kind: `"GPU"` or `"CPU"` (names the planned devices).
    memory_bytes: the memory budget of each device.
    flops_per_s: sustained training FLOP/s of each device.
    link_bytes_per_s: bandwidth of each device's link.
    link: the link's name, for the table.
    task_overhead_s: fixed time of each forward or backward a device runs
      (one per micro-batch and stage): launching its kernels, sending its
      tensors. It keeps tiny micro-batches from looking free.
  """
  num_devices: int
  device_kind: str
  memory_bytes: int
  flops_per_s: float
  link_bytes_per_s: float
  link: str = ""
  task_overhead_s: float = 0.0

  def __post_init__(self):
    for name in ("num_devices", "memory_bytes", "flops_per_s",
                 "link_bytes_per_s"):
      value = getattr(self, name)
      if isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0.")
    if not self.task_overhead_s >= 0:
      raise ValueError(f"task_overhead_s={self.task_overhead_s!r} must be "
                       ">= 0.")

  def devices(self, count: int) -> list[str]:
    return [f"/device:{self.device_kind}:{i}" for i in range(count)]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout weighed, with its predicted step and memory.

  Attributes:
    strategy: `"mirrored"`, `"model_parallel"` or `"pipeline"`.
    devices: devices it uses (replicas or stages).
    micro_batches: micro-batches per step (1 unless a pipeline).
    schedule: the pipeline's schedule.
    recompute: the pipeline recomputes activations in its backward.
    compute_s: predicted compute time of one step (with pipeline bubbles).
    comm_s: predicted time of the step's all-reduce or stage transfers not
      hidden by compute.
    memory_bytes: estimated memory of the largest device.
    fits: `memory_bytes` is within the budget.
  """
  strategy: str
  devices: int
  micro_batches: int = 1
  schedule: str = "gpipe"
  recompute: bool = False
  compute_s: float = 0.0
  comm_s: float = 0.0
  memory_bytes: int = 0
  fits: bool = False

  @property
  def step_s(self) -> float:
    return self.compute_s + self.comm_s

  @property
  def label(self) -> str:
    if self.strategy == "mirrored":
      return f"mirrored n={self.devices}"
    if self.strategy == "model_parallel":
      return f"model_parallel K={self.devices}"
    return (f"pipeline K={self.devices} M={self.micro_batches} "
            f"{self.schedule}{' recompute' if self.recompute else ''}")

  def options(self) -> dict[str, Any]:
    """The chosen distribution's option values (`TrainConfig` names)."""
    if self.strategy == "mirrored":
      return {"num_replicas": self.devices}
    values: dict[str, Any] = {"num_stages": self.devices}
    if self.strategy == "pipeline":
      values.update(micro_batches=self.micro_batches, schedule=self.schedule,
                    recompute=self.recompute)
    return values

  def _key(self) -> tuple:
    return (self.step_s, self.memory_bytes, _SIMPLICITY[self.strategy],
            self.devices, self.micro_batches)


def _fmt_time(seconds: float) -> str:
  if seconds >= 1:
    return f"{seconds:.2f} s"
  return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else (
      f"{seconds * 1e6:.3g} us")


def _budget(hw: Hardware) -> str:
  """`"16 GB (14.9 GiB)"`: the budget as given and as the table shows bytes."""
  return (f"{hw.memory_bytes / 1e9:.4g} GB "
          f"({plan_lib._fmt_bytes(hw.memory_bytes)})")  # pylint: disable=protected-access


def _dominated(c: Candidate, others: Sequence[Candidate]) -> bool:
  """Another candidate is at least as fast and as small, and better in one."""
  return any(o is not c and o.step_s <= c.step_s and
             o.memory_bytes <= c.memory_bytes and
             (o.step_s, o.memory_bytes) != (c.step_s, c.memory_bytes)
             for o in others)


@dataclasses.dataclass(frozen=True)
class AutoPlan:
  """The layouts weighed and the one chosen (see `plan_layout`).

  Attributes:
    candidates: every layout weighed, fastest first (those that fit first).
    chosen: the fastest that fits.
    reason: why it was chosen, in one sentence.
    hardware: what was planned for.
    global_batch_size: examples per step.
    optimizer: the optimizer whose slots were counted.
  """
  candidates: tuple[Candidate, ...]
  chosen: Candidate
  reason: str
  hardware: Hardware
  global_batch_size: int
  optimizer: str | int = "adam"

  def shown(self) -> list[Candidate]:
    """The candidates a table lists by default: none that another beats in
    both time and memory, plus every data-parallel one and the fastest of
    each layout that fits."""
    best = {}
    for c in self.candidates:
      if c.fits:
        best.setdefault(c.strategy, c)
    return [c for c in self.candidates
            if c.strategy == "mirrored" or c in best.values()
            or not _dominated(c, self.candidates)]

  def table(self, everything: bool = False) -> str:
    """The candidates (`shown()`, or all), the choice and why, as text."""
    h = self.hardware
    rows = self.candidates if everything else self.shown()
    header = ("layout", "step (predicted)", "compute", "comm",
              "memory/device", "fits")
    lines = [(c.label, _fmt_time(c.step_s), _fmt_time(c.compute_s),
              _fmt_time(c.comm_s), plan_lib._fmt_bytes(c.memory_bytes),  # pylint: disable=protected-access
              "yes" if c.fits else "no") for c in rows]
    widths = [max(len(r[i]) for r in [header] + lines)
              for i in range(len(header))]
    fmt = lambda r: "  ".join(
        [r[0].ljust(widths[0])] + [v.rjust(w) for v, w in
                                   zip(r[1:], widths[1:])]).rstrip()
    title = (f"strategy=auto: {len(self.candidates)} layouts weighed for "
             f"{h.num_devices} {h.device_kind} device(s), "
             f"{_budget(h)} each, "
             f"{h.flops_per_s / 1e12:.3g} TFLOP/s, link {h.link or '?'} "
             f"{h.link_bytes_per_s / 1e9:.3g} GB/s, "
             f"{_fmt_time(h.task_overhead_s)} per task; batch "
             f"{self.global_batch_size}, {self.optimizer} optimizer. "
             "Step times are predicted by the cost model, not measured.")
    out = [title, fmt(header)] + [fmt(r) for r in lines]
    hidden = len(self.candidates) - len(rows)
    if hidden:
      out.append(f"(+ {hidden} more weighed, each slower than a listed one "
                 "and using no less memory)")
    out.append(f"chosen: {self.chosen.label}. {self.reason}")
    return "\n".join(out)

  def __str__(self) -> str:
    return self.table()


def _peak(estimates: dict[str, plan_lib.MemoryEstimate]) -> int:
  return max(e.total for e in estimates.values())


def _data_parallel(whole: plan_lib.StagePlan, n: int, hw: Hardware,
                   batch: int, optimizer: str | int) -> Candidate:
  """Replicas on `n` devices: `batch / n` examples each, then a ring
  all-reduce of one gradient per trainable weight."""
  stage = whole.stages[0]
  per_replica = batch // n
  compute = ((1 + BACKWARD_FACTOR) * stage.flops * per_replica /
             hw.flops_per_s + 2 * hw.task_overhead_s)
  comm = (2 * (n - 1) / n * stage.trainable_param_bytes /
          hw.link_bytes_per_s)
  memory = _peak(whole.memory_estimate(per_replica, optimizer=optimizer))
  return Candidate("mirrored", n, compute_s=compute, comm_s=comm,
                   memory_bytes=memory, fits=memory <= hw.memory_bytes)


def _staged(plan: plan_lib.StagePlan, hw: Hardware, batch: int,
            optimizer: str | int, strategy: str, micro_batches: int = 1,
            schedule: str = "gpipe", recompute: bool = False) -> Candidate:
  """Stages of `plan` fed `micro_batches`: the simulated step, with and
  without the transfers between stages."""
  from tfmgpu.parallel import timeline  # pylint: disable=g-import-not-at-top
  micro = batch // micro_batches
  fwd = [s.flops * micro / hw.flops_per_s for s in plan.stages]
  bwd = [f * (BACKWARD_FACTOR + (1 if recompute else 0)) +
         hw.task_overhead_s for f in fwd]
  fwd = [f + hw.task_overhead_s for f in fwd]
  transfer = (max(s.sent_bytes for s in plan.stages) * micro /
              hw.link_bytes_per_s)
  run = lambda delay: timeline.simulate(
      fwd, bwd, micro_batches, schedule=schedule,
      transfer_time=delay).step_time
  compute = run(0.0)
  memory = _peak(plan.memory_estimate(
      batch, optimizer=optimizer, micro_batches=micro_batches,
      schedule=schedule, recompute=recompute))
  return Candidate(strategy, plan.num_stages, micro_batches, schedule,
                   recompute, compute_s=compute,
                   comm_s=run(transfer) - compute, memory_bytes=memory,
                   fits=memory <= hw.memory_bytes)


def _counts(limit: int) -> list[int]:
  """2, 4, 8, ... up to `limit`, and `limit` itself."""
  out, k = [], 2
  while k <= limit:
    out.append(k)
    k *= 2
  return out + ([limit] if limit >= 2 and limit not in out else [])


def _stage_candidates(plan: plan_lib.StagePlan, hw: Hardware, batch: int,
                      optimizer: str | int) -> list[Candidate]:
  """`model_parallel` over the plan's stages, and every pipeline of them."""
  out = [_staged(plan, hw, batch, optimizer, "model_parallel")]
  for m in MICRO_BATCHES:
    if m > batch or batch % m:
      continue
    for schedule in SCHEDULES:
      for recompute in (False, True):
        out.append(_staged(plan, hw, batch, optimizer, "pipeline", m,
                           schedule, recompute))
  return out


def weigh_layouts(model: Any, hardware: Hardware, *, global_batch_size: int,
                  optimizer: str | int = "adam", partition: str = "balanced"
                  ) -> list[Candidate]:
  """Every layout of `hardware`'s devices, costed (see the module docstring).

  Args:
    model: a built Keras model (weights or shapes only).
    hardware: the devices.
    global_batch_size: examples per step.
    optimizer: optimizer name or slots per trainable weight.
    partition: what stage splits balance.

  Returns:
    The candidates, fastest first among those that fit, then the others.
  """
  from tfmgpu.parallel import partition as partition_lib  # pylint: disable=g-import-not-at-top
  if isinstance(global_batch_size, bool) or not (
      isinstance(global_batch_size, int) and global_batch_size >= 1):
    raise ValueError(f"global_batch_size={global_batch_size!r} must be a "
                     "positive int.")
  plan = lambda k: partition_lib.plan_stages(
      model, k, criterion=partition, devices=hardware.devices(k),
      check_devices=False)
  whole = plan(1)
  n_all = hardware.num_devices
  out = [_data_parallel(whole, n, hardware, global_batch_size, optimizer)
         for n in sorted({1, *_counts(n_all)}) if global_batch_size % n == 0]
  for k in _counts(min(n_all, len(whole.layer_names))):
    try:
      out += _stage_candidates(plan(k), hardware, global_batch_size,
                               optimizer)
    except ValueError:  # This model cannot be cut into k stages.
      continue
  return sorted(out, key=lambda c: (not c.fits, c._key()))  # pylint: disable=protected-access


def _reason(chosen: Candidate, candidates: Sequence[Candidate],
            hw: Hardware) -> str:
  """Why `chosen` won: the fastest that fits, and what the whole-host data
  parallelism and the best other layout would have been."""
  fitting = [c for c in candidates if c.fits]
  budget = _budget(hw)
  why = [f"Fastest predicted step ({_fmt_time(chosen.step_s)}) of the "
         f"{len(fitting)} of {len(candidates)} layouts that fit in {budget} "
         "per device."]
  dp = next((c for c in candidates if c.strategy == "mirrored"
             and c.devices == hw.num_devices), None)
  if dp is not None and dp is not chosen:
    if not dp.fits:
      why.append(f"{dp.label} would need "
                 f"{plan_lib._fmt_bytes(dp.memory_bytes)} per device, over "  # pylint: disable=protected-access
                 "the budget.")
    else:
      why.append(f"{dp.label} is predicted at {_fmt_time(dp.step_s)}, of "
                 f"which {_fmt_time(dp.comm_s)} is its gradient all-reduce.")
  other = next((c for c in fitting if c.strategy != chosen.strategy
                and c is not dp), None)
  if other is not None:
    why.append(f"Best other layout: {other.label} at "
               f"{_fmt_time(other.step_s)}.")
  return " ".join(why)


def plan_layout(model: Any, hardware: Hardware, *, global_batch_size: int,
                optimizer: str | int = "adam", partition: str = "balanced"
                ) -> AutoPlan:
  """Chooses the fastest predicted layout that fits (see the module
  docstring); arguments as `weigh_layouts`.

  Raises:
    ValueError: no layout's estimate fits `hardware.memory_bytes`; the
      message names the smallest estimate and the budget.
  """
  candidates = weigh_layouts(model, hardware,
                             global_batch_size=global_batch_size,
                             optimizer=optimizer, partition=partition)
  if not candidates:
    raise ValueError(f"No layout of {hardware.num_devices} device(s) can run "
                     f"global_batch_size={global_batch_size}.")
  if not candidates[0].fits:
    small = min(candidates, key=lambda c: c.memory_bytes)
    fmt = plan_lib._fmt_bytes  # pylint: disable=protected-access
    raise ValueError(
        f"No layout fits the memory budget of {_budget(hardware)} "
        f"per device on {hardware.num_devices} {hardware.device_kind} "
        f"device(s): the smallest estimate is {small.label} at "
        f"{fmt(small.memory_bytes)} per device. Use more devices, a smaller "
        "global batch or model, or a larger device_memory_gb if the devices "
        "hold more.")
  chosen = candidates[0]
  return AutoPlan(tuple(candidates), chosen,
                  _reason(chosen, candidates, hardware), hardware,
                  global_batch_size, optimizer)
