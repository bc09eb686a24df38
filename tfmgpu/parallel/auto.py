"""Picks a layout for a model and devices from the cost model: `plan_layout`.

The layouts weighed are the ones tfmgpu builds, and their hybrids: data
parallelism (`mirrored` over n of the devices), model parallelism
(`model_parallel` over K stages), pipelines (`pipeline` over K stages, M
micro-batches, GPipe, 1F1B or interleaved 1F1B with `VIRTUAL_STAGES`
chunks per device, with or without recomputation), tensor
parallelism (`tensor_parallel`: the layers the tensor rules name split over
T in `TENSOR_SIZES`, only where their heads and widths divide and T devices
fit in one host), and `R` data-parallel copies of stages, of shards or of
both (`R * K * T` devices at most), and data parallelism with its state
sharded (ZeRO stages 1-3, `tfmgpu.parallel.zero_cost`). Each is costed by
`tfmgpu.parallel.accounting` from the model's costs
(`tfmgpu.parallel.cost`, per stage as `plan_stages` cuts it):

* memory per device: `StagePlan.memory_estimate` of each device's share
  (split layers divided by T; data parallelism: the whole model as one
  stage, on `batch / n` examples), the largest device's;
* predicted step time, assuming every device computes at `flops_per_s`
  (a backward costs `BACKWARD_FACTOR` forwards; recomputation adds one
  forward; each forward and backward a device runs adds a fixed
  `task_overhead_s`) and each link moves `link_bytes_per_s` (the network's
  bandwidth for a group spanning hosts):
  - stages: `tfmgpu.parallel.timeline.simulate` of the schedule with each
    stage's forward and backward time per micro-batch (plus its tensor
    all-reduces), and the largest cut's bytes per micro-batch / bandwidth
    as every transfer's delay (model parallelism: one micro-batch);
  - data parallelism: then a ring all-reduce of each device's gradients
    over the R copies, `2 (R - 1) / R * gradient bytes / bandwidth` (no
    overlap with the backward).

The fastest layout whose estimate fits `memory_bytes` wins (ties: less
memory, then the simpler layout); none that does not fit is ever chosen.
These are predictions of a cost model, not measurements: framework
workspace, kernel efficiency, and logical CPUs sharing one host's cores are
not modelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu.parallel import accounting
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import zero_cost

# Backward FLOPs per forward FLOP (gradients of inputs and of weights).
BACKWARD_FACTOR = accounting.BACKWARD_FACTOR
# The devices planned for (defined with the accounting that reads them).
Hardware = accounting.Hardware
# Tensor-parallel sizes weighed (those the split layers' sizes divide).
TENSOR_SIZES = (2, 4, 8)
# Micro-batch counts weighed for a pipeline (those the batch divides).
MICRO_BATCHES = (2, 4, 8, 16, 32)
SCHEDULES = ("gpipe", "1f1b")
# Chunks per device weighed for interleaved 1F1B.
VIRTUAL_STAGES = (2,)
# Simpler first: the tie-break between equally fast, equally large layouts.
_SIMPLICITY = {"mirrored": 0, "model_parallel": 1, "pipeline": 2,
               "tensor_parallel": 3}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout weighed, with its predicted step and memory.

  Attributes:
    strategy: `"mirrored"`, `"model_parallel"`, `"pipeline"` or
      `"tensor_parallel"`.
    devices: replicas (`mirrored`), stages (`model_parallel`, `pipeline`)
      or shards (`tensor_parallel`).
    micro_batches: micro-batches per step of each replica (1 unless a
      pipeline).
    schedule: the pipeline's schedule.
    recompute: the pipeline recomputes activations in its backward.
    compute_s: predicted compute time of one step (with pipeline bubbles).
    comm_s: predicted time the step's all-reduces and stage transfers add
      to compute.
    memory_bytes: estimated memory of the largest device.
    fits: `memory_bytes` is within the budget.
    data: `R`, data-parallel copies of the stages or shards (1 for
      `mirrored`, whose replicas are `devices`).
    tensor: `T`, devices each split layer is sharded over.
    sent_bytes: bytes the busiest device sends per step (all kinds).
    account: the `accounting.LayoutAccount` behind the numbers.
    zero_stage: `mirrored`'s ZeRO stage (`tfmgpu.parallel.zero_cost`).
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
  data: int = 1
  tensor: int = 1
  sent_bytes: int = 0
  virtual_stages: int = 1
  account: Any = dataclasses.field(default=None, compare=False, repr=False)
  zero_stage: int = 0

  @property
  def step_s(self) -> float:
    return self.compute_s + self.comm_s

  @property
  def num_devices(self) -> int:
    """All the devices the layout uses."""
    if self.strategy in ("mirrored", "tensor_parallel"):
      return self.data * self.devices
    return self.data * self.devices * self.tensor

  @property
  def label(self) -> str:
    """E.g. `mirrored n=4`, `data 2 x pipeline K=2 M=4 gpipe x tensor 2`."""
    if self.strategy == "mirrored":
      zero = f" zero {self.zero_stage}" if self.zero_stage else ""
      return f"mirrored n={self.devices}{zero}"
    parts = [f"data {self.data}"] if self.data > 1 else []
    if self.strategy == "model_parallel":
      parts.append(f"model_parallel K={self.devices}")
    elif self.strategy == "pipeline":
      virtual = (f" V={self.virtual_stages}" if self.virtual_stages > 1
                 else "")
      parts.append(f"pipeline K={self.devices} M={self.micro_batches} "
                   f"{self.schedule}{virtual}"
                   f"{' recompute' if self.recompute else ''}")
    if self.tensor > 1:
      parts.append(f"tensor {self.tensor}")
    return " x ".join(parts)

  def options(self) -> dict[str, Any]:
    """The chosen distribution's option values (`TrainConfig` names)."""
    if self.strategy == "mirrored":
      zero = {"zero_stage": self.zero_stage} if self.zero_stage else {}
      return {"num_replicas": self.devices, **zero}
    if self.strategy == "tensor_parallel":
      values: dict[str, Any] = {"tensor_parallel": self.tensor}
    else:
      values = {"num_stages": self.devices}
      if self.tensor > 1:
        values["tensor_parallel"] = self.tensor
    if self.strategy == "pipeline":
      values.update(micro_batches=self.micro_batches, schedule=self.schedule,
                    recompute=self.recompute)
      if self.virtual_stages > 1:
        values["virtual_stages"] = self.virtual_stages
    if self.data > 1:
      values["data_parallel"] = self.data
    return values

  @property
  def family(self) -> tuple[str, bool, bool, int]:
    """The kind of layout: its strategy, with data copies, with shards,
    its ZeRO stage."""
    return (self.strategy, self.data > 1, self.tensor > 1, self.zero_stage)

  def _key(self) -> tuple:
    return (self.step_s, self.memory_bytes,
            _SIMPLICITY[self.strategy] + (self.data > 1) + (self.tensor > 1)
            + self.zero_stage,
            self.num_devices, self.micro_batches)


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
    notes: what the chosen layout changes in training, a line each.
  """
  candidates: tuple[Candidate, ...]
  chosen: Candidate
  reason: str
  hardware: Hardware
  global_batch_size: int
  optimizer: str | int = "adam"
  notes: tuple[str, ...] = ()

  def shown(self) -> list[Candidate]:
    """The candidates a table lists by default: none that another beats in
    both time and memory, plus every data-parallel one and the fastest of
    each layout that fits."""
    best = {}
    for c in self.candidates:
      if c.fits:
        best.setdefault(c.family, c)
    return [c for c in self.candidates
            if (c.strategy == "mirrored" and not c.zero_stage)
            or c in best.values()
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
    return "\n".join(out + list(self.notes))

  def __str__(self) -> str:
    return self.table()


def _weigh(plan: plan_lib.StagePlan, split: accounting.TensorSplit,
           hw: Hardware, batch: int, optimizer: str | int, strategy: str, *,
           data: int = 1, tensor: int = 1, micro_batches: int = 1,
           schedule: str = "gpipe", recompute: bool = False,
           virtual_stages: int = 1) -> Candidate:
  """The layout's `accounting.account_layout` and predicted step on `hw`,
  as a candidate (`data` replicas of `plan`'s stages, each split over
  `tensor` devices)."""
  acc = accounting.account_layout(
      plan, split, global_batch_size=batch, data=data, tensor=tensor,
      micro_batches=micro_batches, schedule=schedule, recompute=recompute,
      optimizer=optimizer, devices=hw.devices(plan.num_stages * tensor),
      virtual_stages=virtual_stages)
  step = acc.step(hw)
  memory = acc.peak.memory.total
  devices = {"mirrored": data, "tensor_parallel": tensor}.get(
      strategy, plan.num_stages)
  return Candidate(strategy, devices, micro_batches, schedule, recompute,
                   compute_s=step.compute_s, comm_s=step.comm_s,
                   memory_bytes=memory, fits=memory <= hw.memory_bytes,
                   data=1 if strategy == "mirrored" else data, tensor=tensor,
                   sent_bytes=max(d.sent.total for d in acc.devices),
                   virtual_stages=virtual_stages, account=acc)


def _counts(limit: int) -> list[int]:
  """2, 4, 8, ... up to `limit`, and `limit` itself."""
  out, k = [], 2
  while k <= limit:
    out.append(k)
    k *= 2
  return out + ([limit] if limit >= 2 and limit not in out else [])


def _stage_candidates(plan: plan_lib.StagePlan,
                      split: accounting.TensorSplit, hw: Hardware,
                      batch: int, optimizer: str | int, data: int,
                      tensor: int) -> list[Candidate]:
  """`model_parallel` over the plan's stages, and every pipeline of them
  (`data` copies, split over `tensor` devices)."""
  if batch % data:
    return []
  sizes = dict(data=data, tensor=tensor)
  out = [_weigh(plan, split, hw, batch, optimizer, "model_parallel",
                **sizes)]
  for m in MICRO_BATCHES:
    if m * data > batch or batch % (m * data):
      continue
    for schedule, v in _schedules(plan, m, tensor):
      for recompute in (False, True):
        out.append(_weigh(plan, split, hw, batch, optimizer, "pipeline",
                          micro_batches=m, schedule=schedule,
                          recompute=recompute, virtual_stages=v, **sizes))
  return out


def _schedules(plan: plan_lib.StagePlan, m: int, tensor: int = 1
               ) -> list[tuple[str, int]]:
  """`(schedule, virtual stages)` weighed at `m` micro-batches: each of
  `SCHEDULES`, and interleaved 1F1B with `VIRTUAL_STAGES` chunks per
  device where `m` is a multiple of the stages, the plan has a layer for
  every chunk and no layer is split over `tensor` devices (not built)."""
  K = plan.num_stages
  layers = sum(len(s.layers) for s in plan.stages)
  return [(s, 1) for s in SCHEDULES] + [
      ("1f1b", v) for v in VIRTUAL_STAGES
      if K > 1 and m % K == 0 and layers >= K * v and tensor == 1]


def _tensor_sizes(split: accounting.TensorSplit, hw: Hardware) -> list[int]:
  """1, and the `TENSOR_SIZES` the split layers allow inside one host."""
  host = hw.devices_per_host or hw.num_devices
  return [1] + [t for t in TENSOR_SIZES
                if t <= min(host, hw.num_devices) and split.why_not(t) is None]


def _unstaged_candidates(whole: plan_lib.StagePlan,
                         split: accounting.TensorSplit, hw: Hardware,
                         batch: int, optimizer: str | int) -> list[Candidate]:
  """Data parallelism over n devices, and tensor parallelism over T (with
  data-parallel copies): the model in one stage."""
  out = []
  for tensor in _tensor_sizes(split, hw):
    for data in sorted({1, *_counts(hw.num_devices // tensor)}):
      if batch % data == 0:
        out.append(_weigh(whole, split, hw, batch, optimizer,
                          "mirrored" if tensor == 1 else "tensor_parallel",
                          data=data, tensor=tensor))
  return out


def weigh_layouts(model: Any, hardware: Hardware, *, global_batch_size: int,
                  optimizer: str | int = "adam", partition: str = "balanced",
                  input_shape: Any = None) -> list[Candidate]:
  """Every layout of `hardware`'s devices, costed (see the module docstring).

  Args:
    model: a built Keras model (weights or shapes only).
    hardware: the devices.
    global_batch_size: examples per step.
    optimizer: optimizer name or slots per trainable weight.
    partition: what stage splits balance.
    input_shape: one example's shape, for a model whose sequence length
      neither its inputs nor its config give (`plan_stages`).

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
      check_devices=False, input_shape=input_shape)
  try:
    whole = plan(1)
  except ValueError as e:
    if _compat.has_graph(model):
      raise
    raise ValueError(  # No graph to cost (a subclassed model).
        f"strategy 'auto' weighs layouts from the model's layer graph, and "
        f"{e} To train it on several devices as it is, use data "
        "parallelism: --strategy=mirrored (Python: tfmgpu.get_strategy("
        "'mirrored')), which runs its call().") from e
  split = accounting.tensor_split(model)
  n_all = hardware.num_devices
  out = _unstaged_candidates(whole, split, hardware, global_batch_size,
                             optimizer)
  out += zero_cost.zero_variants(model, out, hardware, optimizer)
  for k in _counts(min(n_all, len(whole.layer_names))):
    try:
      staged = plan(k)
    except ValueError:  # This model cannot be cut into k stages.
      continue
    for tensor in _tensor_sizes(split, hardware):
      if k * tensor > n_all:
        continue
      for data in [1, *_counts(n_all // (k * tensor))]:
        out += _stage_candidates(staged, split, hardware, global_batch_size,
                                 optimizer, data, tensor)
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
             and c.devices == hw.num_devices and not c.zero_stage), None)
  if dp is not None and dp is not chosen:
    if not dp.fits:
      why.append(f"{dp.label} would need "
                 f"{plan_lib._fmt_bytes(dp.memory_bytes)} per device, over "  # pylint: disable=protected-access
                 "the budget.")
    else:
      why.append(f"{dp.label} is predicted at {_fmt_time(dp.step_s)}, of "
                 f"which {_fmt_time(dp.comm_s)} is its gradient all-reduce.")
  other = next((c for c in fitting if c.family != chosen.family
                and c is not dp), None)
  if other is not None:
    why.append(f"Best other layout: {other.label} at "
               f"{_fmt_time(other.step_s)}.")
  return " ".join(why)


def plan_layout(model: Any, hardware: Hardware, *, global_batch_size: int,
                optimizer: str | int = "adam", partition: str = "balanced",
                input_shape: Any = None) -> AutoPlan:
  """Chooses the fastest predicted layout that fits (see the module
  docstring); arguments as `weigh_layouts`.

  Raises:
    ValueError: no layout's estimate fits `hardware.memory_bytes`; the
      message names the smallest estimate and the budget.
  """
  candidates = weigh_layouts(model, hardware,
                             global_batch_size=global_batch_size,
                             optimizer=optimizer, partition=partition,
                             input_shape=input_shape)
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
                  global_batch_size, optimizer,
                  _length_note(model, input_shape) + _notes(model, chosen))


def _length_note(model: Any, input_shape: Any) -> tuple[str, ...]:
  """A line when the costs counted a length as 1 (none known): every
  prediction above it is then far too small."""
  from tfmgpu.parallel import graph as graph_lib  # pylint: disable=g-import-not-at-top
  graph = graph_lib.ModelGraph(model, input_shape=input_shape)
  unknown = graph.unknown()
  if not unknown:
    return ()
  return (f"note: UNKNOWN length ({graph.describe(unknown[0])}): every "
          "cost above counts it as 1, far too few; plan again with "
          "input_shape=<one example's shape>.",)


def _notes(model: Any, chosen: Candidate) -> tuple[str, ...]:
  """What `chosen` changes in training: a pipeline's micro-batches each
  normalise their own rows in a training BatchNormalization (the pipeline
  warns again when it is built)."""
  if chosen.micro_batches <= 1:
    return ()
  norms = checks.training_norms(model)
  if not norms:
    return ()
  return (f"note: its {chosen.micro_batches} micro-batches change "
          f"BatchNormalization's statistics ({', '.join(norms)} normalise "
          "each micro-batch's rows by their own), so training differs from "
          "the unsplit model's.",)
