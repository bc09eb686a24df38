"""The stage plan: which layers go to which device, with their costs.

A `StagePlan` is data: its `Stage`s (layers, device, parameter bytes, FLOPs,
activation bytes, and the tensors and bytes each sends to the next),
validated when built, printable as a table (`str(plan)`), with a per-device
training-memory estimate (`memory_estimate`, printable with `memory_table`)
that counts activations per micro-batch in flight, with and without
recomputation. `tfmgpu.parallel.partition.plan_stages` makes one.

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses

from tfmgpu.parallel import choices

# Slot variables per trainable weight kept by common optimizers.
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "rmsprop": 1, "adagrad": 1,
                   "adam": 2, "adamw": 2, "nadam": 2, "adamax": 2, "lion": 1}


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


def _fmt_sent(sent: tuple[str, ...]) -> str:
  """`"-"`, or the count of tensors sent and their names (abridged)."""
  if not sent:
    return "-"
  names = ", ".join(sent[:3]) + (", ..." if len(sent) > 3 else "")
  return f"{len(sent)}: {names}"


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
    activation_bytes: bytes per example its layers keep for the backward
      pass (their outputs, and attention's projections and scores:
      `tfmgpu.parallel.cost.node_activation_bytes`).
    input_bytes: bytes of the tensors it receives per example (the model
      inputs for stage 0).
    sent_bytes: bytes of every tensor it sends to the next stage per
      example (and receives back as gradients); 0 for the last stage.
    sent: the tensors it sends, named by the layer that makes them (or the
      model input's name), in the order the next stage takes them.
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
  sent: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SharedStages:
  """A weight that layers on several stages use (a tied embedding).

  It stays one variable: the first stage holds it, the others read it each
  step, and its gradient is the sum over every use
  (`tfmgpu.parallel.shared`).

  Attributes:
    path: the variable's Keras path (`token_embedding/embeddings`).
    layers: the top-level layers that hold it, the owner first.
    stages: the stages those layers are on, in order, each once.
    bytes: the weight's bytes (counted in each of those stages'
      `param_bytes`; the optimizer slots live on the first stage only).
  """
  path: str
  layers: tuple[str, ...]
  stages: tuple[int, ...]
  bytes: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Estimated bytes one device holds while training (see `memory_estimate`).

  Attributes:
    device: the device.
    weights: bytes of its stages' weights.
    gradients: bytes of one gradient per trainable weight.
    optimizer_slots: bytes of the optimizer's slot variables.
    activations: bytes kept for the backward pass at the peak of a step.
    in_flight: micro-batches whose activations each of its stages holds at
      once, in stage order (empty when not given).
  """
  device: str
  weights: int
  gradients: int
  optimizer_slots: int
  activations: int
  in_flight: tuple[int, ...] = ()

  @property
  def total(self) -> int:
    return self.weights + self.gradients + self.optimizer_slots + self.activations


def micro_batches_in_flight(schedule: str, num_stages: int, stage_index: int,
                            micro_batches: int) -> int:
  """Micro-batches whose activations stage `stage_index` holds at once.

  GPipe runs every forward before any backward: all `micro_batches`. 1F1B
  starts micro-batch `m + K - k` on stage `k` only after the backward of
  `m`: at most `min(K - k, micro_batches)`.
  """
  if schedule not in choices.SCHEDULE_CHOICES:
    raise ValueError(f"schedule={schedule!r} is unknown; choose one of "
                     f"{', '.join(choices.SCHEDULE_CHOICES)}.")
  if not 0 <= stage_index < num_stages:
    raise ValueError(f"stage_index={stage_index} must be in 0..{num_stages - 1}.")
  if schedule == "gpipe":
    return micro_batches
  return min(num_stages - stage_index, micro_batches)


def _stage_activations(stage: Stage, micro_batch: int, in_flight: int,
                       recompute: bool) -> int:
  """Bytes a stage keeps for its backward at the peak of a step.

  Without recomputation: its input and what its layers keep, for each
  micro-batch in flight. With it: only its input per micro-batch in flight,
  plus one micro-batch's layer outputs (the forward re-run in a backward).
  """
  if recompute:
    return micro_batch * (in_flight * stage.input_bytes +
                          stage.activation_bytes)
  return in_flight * micro_batch * (stage.input_bytes + stage.activation_bytes)


def _optimizer_slots(optimizer: str | int) -> int:
  """Slots per trainable weight of an optimizer name, or the number given."""
  if isinstance(optimizer, str):
    if optimizer.lower() not in OPTIMIZER_SLOTS:
      raise ValueError(
          f"optimizer={optimizer!r} is unknown; use one of "
          f"{', '.join(OPTIMIZER_SLOTS)} or the number of slots per weight.")
    return OPTIMIZER_SLOTS[optimizer.lower()]
  return int(optimizer)


def format_memory(estimates: dict[str, MemoryEstimate], title: str = "") -> str:
  """Memory estimates as a table: per device its weights, gradients,
  optimizer slots, activations (and micro-batches in flight per stage) and
  total; a last row names the largest total."""
  header = ("device", "weights", "grads", "slots", "activations",
            "in flight", "total")
  rows = [(e.device, _fmt_bytes(e.weights), _fmt_bytes(e.gradients),
           _fmt_bytes(e.optimizer_slots), _fmt_bytes(e.activations),
           "+".join(str(f) for f in e.in_flight) or "-", _fmt_bytes(e.total))
          for e in estimates.values()]
  if estimates:
    peak = max(estimates.values(), key=lambda e: e.total)
    rows.append(("max", "", "", "", "", "", _fmt_bytes(peak.total)))
  widths = [max(len(r[i]) for r in [header] + rows)
            for i in range(len(header))]
  line = lambda r: "  ".join([r[0].ljust(widths[0])] + [
      c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip()
  lines = [title] if title else []
  return "\n".join(lines + [line(header)] + [line(r) for r in rows])


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """Which layers go to which device, with their costs. Print it for a table.

  Attributes:
    stages: the stages in order.
    criterion: what the split balanced (`"balanced"`, `"params"`, `"flops"`,
      or `"split_points"` when the split was given).
    model_name: the model the plan was made for.
    shared: the weights used on more than one stage (`SharedStages`).
    unknown_length: a tensor of unknown length that the costs count as
      length 1 (no `input_shape` given, none in the model's config), as
      `ModelGraph.describe` names it; `None` when every length is known.
  """
  stages: tuple[Stage, ...]
  criterion: str
  model_name: str = ""
  shared: tuple[SharedStages, ...] = ()
  unknown_length: str | None = None

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
                      optimizer: str | int = "adam", micro_batches: int = 1,
                      schedule: str = "gpipe", recompute: bool = False
                      ) -> dict[str, MemoryEstimate]:
    """Estimates the training memory of each device.

    Per stage: its weights; one gradient per trainable weight; the optimizer's
    slots (`optimizer` names one of `OPTIMIZER_SLOTS` or gives the number of
    slots per weight); and the activations kept for the backward pass, per
    micro-batch of `batch_size / micro_batches` examples: GPipe keeps every
    micro-batch in flight, 1F1B at most `K - k` on stage `k`
    (`micro_batches_in_flight`). Without recomputation a micro-batch in
    flight keeps the stage's input and what its layers keep
    (`Stage.activation_bytes`); with it, only the stage's input, plus one
    micro-batch's layer activations while its forward is re-run. Stages
    sharing a device add up. A weight shared between stages
    (`SharedStages`) counts on each of them (it is read there, and gets a
    gradient there) but its slots only on its first. Framework workspace, temporaries of one op and
    fragmentation are not counted. The defaults (one micro-batch) describe
    a `StagedModel`.

    Args:
      batch_size: examples per step on each stage.
      optimizer: optimizer name or slots per trainable weight. Defaults to
        `"adam"` (2 slots).
      micro_batches: micro-batches per step; `batch_size` must divide.
      schedule: `"gpipe"` or `"1f1b"`.
      recompute: the backward re-runs each stage's forward.

    Returns:
      `{device: MemoryEstimate}` in stage order.
    """
    for name, value in (("batch_size", batch_size),
                        ("micro_batches", micro_batches)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int.")
    if batch_size % micro_batches:
      raise ValueError(f"batch_size={batch_size} must divide into "
                       f"micro_batches={micro_batches} equal micro-batches.")
    slots = _optimizer_slots(optimizer)
    out: dict[str, MemoryEstimate] = {}
    for s in self.stages:
      flight = micro_batches_in_flight(schedule, self.num_stages, s.index,
                                       micro_batches)
      prev = out.get(s.device, MemoryEstimate(s.device, 0, 0, 0, 0))
      out[s.device] = MemoryEstimate(
          s.device,
          prev.weights + s.param_bytes,
          prev.gradients + s.trainable_param_bytes,
          prev.optimizer_slots + slots * (s.trainable_param_bytes -
                                          self._read_bytes(s.index)),
          prev.activations + _stage_activations(
              s, batch_size // micro_batches, flight, recompute),
          prev.in_flight + (flight,))
    return out

  def _read_bytes(self, index: int) -> int:
    """Bytes of the shared weights stage `index` reads from an earlier
    stage (counted in its `param_bytes`, held by the owner)."""
    return sum(w.bytes for w in self.shared if index in w.stages[1:])

  def memory_table(self, batch_size: int, *, optimizer: str | int = "adam",
                   micro_batches: int = 1, schedule: str = "gpipe",
                   recompute: bool = False) -> str:
    """`memory_estimate` as a plain-text table: one row per device, then the
    largest total (the device that must fit)."""
    estimates = self.memory_estimate(
        batch_size, optimizer=optimizer, micro_batches=micro_batches,
        schedule=schedule, recompute=recompute)
    if micro_batches == 1:
      how = f"batch {batch_size}"
    else:
      how = (f"batch {batch_size} = {micro_batches} micro-batches of "
             f"{batch_size // micro_batches}, {schedule}")
    title = (f"Estimated training memory per device ({how}, "
             f"{'recompute' if recompute else 'no recompute'}, "
             f"{optimizer} optimizer slots):")
    return format_memory(estimates, title)

  def table(self) -> str:
    """A plain-text table: one row per stage, then the totals."""
    header = ("stage", "device", "layers", "params", "FLOPs/ex", "sends/ex",
              "tensors")
    rows = []
    for s in self.stages:
      names = (s.layers[0] if len(s.layers) == 1 else
               f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})")
      rows.append((str(s.index), s.device, names, _fmt_bytes(s.param_bytes),
                   _fmt_count(s.flops),
                   _fmt_bytes(s.sent_bytes) if s.sent_bytes else "-",
                   _fmt_sent(s.sent)))
    rows.append(("total", "", f"{len(self.layer_names)} layers",
                 _fmt_bytes(sum(s.param_bytes for s in self.stages) -
                            sum(self._read_bytes(s.index)
                                for s in self.stages)),
                 _fmt_count(sum(s.flops for s in self.stages)),
                 _fmt_bytes(sum(s.sent_bytes for s in self.stages)),
                 str(sum(len(s.sent) for s in self.stages))))
    widths = [max(len(r[i]) for r in [header] + rows)
              for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    title = (f"StagePlan for {self.model_name!r}: {self.num_stages} stage(s), "
             f"criterion={self.criterion}")
    return "\n".join([title, line(header)] + [line(r) for r in rows] +
                     self._shared_lines() + self._length_lines())

  def _length_lines(self) -> list[str]:
    """What the table says when lengths were unknown (its costs too few)."""
    if not self.unknown_length:
      return []
    return [f"UNKNOWN length ({self.unknown_length}): FLOPs and bytes above "
            "count it as 1, far too few; plan again with input_shape=<one "
            "example's shape>."]

  def _shared_lines(self) -> list[str]:
    """What the table says about weights used on several stages."""
    if not self.shared:
      return []
    lines = ["shared weights (one variable on the first stage's device, read "
             "by the others; gradients summed over every use):"]
    for w in self.shared:
      lines.append(f"  {w.path}: stages {', '.join(map(str, w.stages))} "
                   f"(layers {', '.join(w.layers)})")
    return lines

  def __str__(self) -> str:
    return self.table()
