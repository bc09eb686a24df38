"""Pipeline schedules: the per-stage order of micro-batch work, and a simulator.

A pipeline step over `K` stages and `M` micro-batches is `2 * K * M` tasks:
the forward `F(k, m)` and backward `B(k, m)` of stage `k` on micro-batch `m`.
A schedule fixes the order in which each stage runs its own tasks
(`stage_orders`); data dependencies do the rest:

* `F(k, m)` needs `F(k - 1, m)` (the activation it receives);
* `B(k, m)` needs `B(k + 1, m)` (the gradient it receives) and its own
  `F(k, m)`; under `"gpipe"` the last stage's backwards need *every*
  micro-batch's forward (the loss is computed once on the whole batch).

Schedules:

* `"gpipe"`: each stage runs `F0 .. F(M-1)`, then `B(M-1) .. B0`. Every
  stage holds the activations of all `M` micro-batches at its peak.
* `"1f1b"` (PipeDream-Flush): stage `k` runs `min(K - k - 1, M)` warm-up
  forwards, then alternates one forward and one backward, then drains the
  remaining backwards. Stage `k` holds at most `min(K - k, M)` micro-batches
  of activations (at most `K`), with the same step time as GPipe when stage
  times are equal.

`PipelinedModel` builds its graph from these orders, and `simulate` predicts
the timeline of the same orders from per-stage forward/backward times:
start and end of every task, step time, per-stage busy time, bubble fraction
(idle share of `K * step_time`), peak activations held, an ASCII Gantt chart
(`Timeline.text`) and a matplotlib plot (`Timeline.plot`; matplotlib is a dev
extra and is imported only there). With equal stage times the bubble is the
textbook `(K - 1) / (M + K - 1)` (`theoretical_bubble`).

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Sequence

FORWARD = "forward"
BACKWARD = "backward"


class Schedule(str, enum.Enum):
  """The order in which each stage runs its micro-batches."""
  GPIPE = "gpipe"         # All forwards, then all backwards.
  ONE_F_ONE_B = "1f1b"    # Warm-up forwards, then one forward, one backward.


@dataclasses.dataclass(frozen=True, order=True)
class Task:
  """The forward or backward of one stage on one micro-batch."""
  stage: int
  micro_batch: int
  kind: str  # FORWARD or BACKWARD.

  def __str__(self) -> str:
    return f"{self.kind[0].upper()}({self.stage},{self.micro_batch})"


def check_schedule(schedule: str | Schedule) -> Schedule:
  """Returns the `Schedule` named by `schedule`.

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  try:
    return Schedule(schedule)
  except ValueError:
    raise ValueError(
        f"schedule={schedule!r} is unknown. Choose one of "
        f"{', '.join(repr(s.value) for s in Schedule)}.") from None


def check_counts(num_stages: int, micro_batches: int) -> None:
  """Raises ValueError unless both counts are positive ints."""
  for key, value in (("num_stages", num_stages),
                     ("micro_batches", micro_batches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{key}={value!r} must be an int >= 1 (e.g. "
                       f"{key}=4).")


def theoretical_bubble(num_stages: int, micro_batches: int) -> float:
  """The idle share `(K - 1) / (M + K - 1)` of a pipeline of equal stages."""
  check_counts(num_stages, micro_batches)
  return (num_stages - 1) / (micro_batches + num_stages - 1)


def stage_orders(num_stages: int, micro_batches: int,
                 schedule: str | Schedule = "gpipe", *,
                 forward_only: bool = False) -> list[list[Task]]:
  """The tasks each stage runs, in its order (see the module docstring).

  Args:
    num_stages: `K`.
    micro_batches: `M`.
    schedule: `"gpipe"` or `"1f1b"`. Defaults to `"gpipe"`.
    forward_only: only the forwards, in micro-batch order (inference).

  Returns:
    `orders[k]`: the tasks of stage `k`.
  """
  check_counts(num_stages, micro_batches)
  schedule = check_schedule(schedule)
  K, M = num_stages, micro_batches
  orders = []
  for k in range(K):
    fwd = [Task(k, m, FORWARD) for m in range(M)]
    bwd = [Task(k, m, BACKWARD) for m in range(M)]
    if forward_only:
      orders.append(fwd)
    elif schedule is Schedule.GPIPE:
      orders.append(fwd + bwd[::-1])
    else:
      warmup = min(K - k - 1, M)
      order = fwd[:warmup]
      for i in range(M - warmup):
        order += [fwd[warmup + i], bwd[i]]
      orders.append(order + bwd[M - warmup:])
  return orders


def dependencies(task: Task, num_stages: int, micro_batches: int,
                 schedule: str | Schedule = "gpipe") -> list[Task]:
  """The tasks whose results `task` consumes (data dependencies only)."""
  k, m = task.stage, task.micro_batch
  if task.kind == FORWARD:
    return [Task(k - 1, m, FORWARD)] if k > 0 else []
  if k < num_stages - 1:
    return [Task(k, m, FORWARD), Task(k + 1, m, BACKWARD)]
  if check_schedule(schedule) is Schedule.GPIPE:  # The whole-batch loss.
    return [Task(k, i, FORWARD) for i in range(micro_batches)]
  return [Task(k, m, FORWARD)]


def build_order(orders: Sequence[Sequence[Task]],
                deps: Callable[[Task], Sequence[Task]]) -> list[Task]:
  """One order of all tasks that respects every stage's order and `deps`.

  This is the order in which `PipelinedModel` creates the graph's ops (an op
  can only be created after its inputs) and in which `simulate` times them.

  Raises:
    ValueError: the orders deadlock (a stage waits for a task that waits,
      directly or not, for that stage).
  """
  position = [0] * len(orders)
  done: set[Task] = set()
  out: list[Task] = []
  total = sum(len(o) for o in orders)
  while len(out) < total:
    progressed = False
    for k, order in enumerate(orders):
      while position[k] < len(order) and all(
          d in done for d in deps(order[position[k]])):
        task = order[position[k]]
        done.add(task)
        out.append(task)
        position[k] += 1
        progressed = True
    if not progressed:
      waiting = [str(o[p]) for o, p in zip(orders, position) if p < len(o)]
      raise ValueError(f"the stage orders deadlock: every stage waits "
                       f"({', '.join(waiting)}).")
  return out


def peak_in_flight(order: Sequence[Task]) -> int:
  """Most micro-batches whose activations one stage holds at once.

  A forward stores its micro-batch's activations until that micro-batch's
  backward on the same stage has run.
  """
  held = peak = 0
  for task in order:
    held += 1 if task.kind == FORWARD else -1
    peak = max(peak, held)
  return peak


# ---------------------------------------------------------------- simulator


@dataclasses.dataclass(frozen=True)
class Event:
  """When one task ran (in the timeline's time unit)."""
  task: Task
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The predicted (or measured) timeline of one pipelined step.

  Attributes:
    num_stages: `K`.
    micro_batches: `M`.
    schedule: the schedule's name.
    events: one per task, in the order they were timed.
  """
  num_stages: int
  micro_batches: int
  schedule: str
  events: tuple[Event, ...]

  @property
  def step_time(self) -> float:
    """From the first start to the last end."""
    return (max(e.end for e in self.events) -
            min(e.start for e in self.events))

  @property
  def busy(self) -> list[float]:
    """Time each stage spends running tasks."""
    out = [0.0] * self.num_stages
    for e in self.events:
      out[e.task.stage] += e.end - e.start
    return out

  @property
  def bubble_fraction(self) -> float:
    """Idle share of all stages over the step: `1 - sum(busy) / (K * step)`."""
    total = self.num_stages * self.step_time
    return 1.0 - sum(self.busy) / total if total > 0 else 0.0

  @property
  def theoretical_bubble(self) -> float:
    return theoretical_bubble(self.num_stages, self.micro_batches)

  @property
  def peak_in_flight(self) -> list[int]:
    """Per stage, most micro-batches of activations held at once."""
    return [peak_in_flight(self.stage_events(k)) for k in
            range(self.num_stages)]

  def stage_events(self, stage: int) -> list[Task]:
    """The tasks of one stage, by start time."""
    events = sorted((e for e in self.events if e.task.stage == stage),
                    key=lambda e: (e.start, e.end))
    return [e.task for e in events]

  def summary(self) -> str:
    """Step time, per-stage busy time, bubble (predicted and textbook)."""
    busy = ", ".join(f"{b:.4g}" for b in self.busy)
    return (f"{self.schedule}: K={self.num_stages} M={self.micro_batches} "
            f"step={self.step_time:.4g} busy=[{busy}] "
            f"bubble={self.bubble_fraction:.3f} "
            f"(theory (K-1)/(M+K-1)={self.theoretical_bubble:.3f})")

  def text(self, width: int = 72) -> str:
    """An ASCII Gantt chart: one row per stage, time left to right.

    Each column shows what its stage runs at the column's mid-time: a digit
    for the forward of micro-batch `m` (`m % 10`), a letter for its backward
    (`a` = 0, `b` = 1, ...), `.` for idle.
    """
    if width < 8:
      raise ValueError(f"width={width} is too narrow; use width >= 8.")
    start = min(e.start for e in self.events)
    span = self.step_time or 1.0
    rows = []
    for k in range(self.num_stages):
      mine = [e for e in self.events if e.task.stage == k]
      cells = []
      for c in range(width):
        t = start + (c + 0.5) * span / width
        hit = next((e for e in mine if e.start <= t < e.end), None)
        if hit is None:
          cells.append(".")
        elif hit.task.kind == FORWARD:
          cells.append(str(hit.task.micro_batch % 10))
        else:
          cells.append(chr(ord("a") + hit.task.micro_batch % 26))
      rows.append(f"stage {k:<2d} |{''.join(cells)}|")
    legend = ("digit m: forward of micro-batch m; letter: its backward "
              "(a=0, b=1, ...); '.': idle")
    return "\n".join([self.summary()] + rows + [legend])

  def plot(self, path: str) -> str:
    """Draws the timeline as a PNG (needs matplotlib, a dev extra).

    Args:
      path: the file to write.

    Returns:
      `path`.

    Raises:
      ImportError: matplotlib is not installed.
    """
    try:
      import matplotlib  # pylint: disable=g-import-not-at-top
      matplotlib.use("Agg")
      from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          "Timeline.plot needs matplotlib, which is a dev extra of tfmgpu: "
          "pip install 'tfmgpu[dev]' (or pip install matplotlib). "
          "Timeline.text() draws the same chart without it.") from e
    fig, ax = plt.subplots(figsize=(10, 0.6 * self.num_stages + 1.2))
    for e in self.events:
      forward = e.task.kind == FORWARD
      ax.broken_barh([(e.start, e.end - e.start)], (e.task.stage - 0.4, 0.8),
                     facecolors="tab:blue" if forward else "tab:orange",
                     edgecolors="black", linewidth=0.5)
      ax.text((e.start + e.end) / 2, e.task.stage,
              f"{'F' if forward else 'B'}{e.task.micro_batch}",
              ha="center", va="center", fontsize=7)
    ax.set_yticks(range(self.num_stages))
    ax.set_yticklabels([f"stage {k}" for k in range(self.num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(self.summary(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _per_stage(times: float | Sequence[float], num_stages: int | None,
               what: str) -> list[float]:
  if isinstance(times, (int, float)):
    if num_stages is None:
      raise ValueError(f"{what}={times!r} is one number; pass num_stages=K "
                       "too, or give one time per stage.")
    times = [float(times)] * num_stages
  times = [float(t) for t in times]
  if not times or any(t < 0 for t in times):
    raise ValueError(f"{what}={times} needs one non-negative time per stage.")
  if num_stages is not None and len(times) != num_stages:
    raise ValueError(f"{what} has {len(times)} time(s) but num_stages="
                     f"{num_stages}; give one per stage.")
  return times


def simulate(forward_times: float | Sequence[float],
             backward_times: float | Sequence[float], micro_batches: int, *,
             schedule: str | Schedule = "gpipe", num_stages: int | None = None,
             transfer_time: float = 0.0) -> Timeline:
  """Predicts the timeline of one pipelined step.

  Each stage runs its tasks in the schedule's order (one at a time, like a
  device's in-order stream); a task starts when its stage is free and its
  inputs have arrived.

  Args:
    forward_times: forward time of one micro-batch on each stage (a list,
      or one number for every stage with `num_stages`).
    backward_times: backward time of one micro-batch on each stage, likewise.
    micro_batches: `M`.
    schedule: `"gpipe"` or `"1f1b"`. Defaults to `"gpipe"`.
    num_stages: `K`, needed when both times are single numbers.
    transfer_time: delay of every activation or gradient sent between
      stages. Defaults to `0`.

  Returns:
    The `Timeline`.

  Raises:
    ValueError: negative or mismatched times, `micro_batches < 1`, or an
      unknown schedule.
  """
  fwd = _per_stage(forward_times, num_stages, "forward_times")
  bwd = _per_stage(backward_times, num_stages or len(fwd), "backward_times")
  K = len(fwd)
  if len(bwd) != K:
    raise ValueError(f"forward_times has {K} stages but backward_times has "
                     f"{len(bwd)}.")
  if transfer_time < 0:
    raise ValueError(f"transfer_time={transfer_time} must be >= 0.")
  schedule = check_schedule(schedule)
  orders = stage_orders(K, micro_batches, schedule)
  deps = lambda t: dependencies(t, K, micro_batches, schedule)
  end: dict[Task, float] = {}
  free = [0.0] * K
  events = []
  for task in build_order(orders, deps):
    ready = free[task.stage]
    for d in deps(task):
      ready = max(ready, end[d] + (transfer_time if d.stage != task.stage
                                   else 0.0))
    cost = (fwd if task.kind == FORWARD else bwd)[task.stage]
    end[task] = free[task.stage] = ready + cost
    events.append(Event(task, ready, ready + cost))
  return Timeline(K, micro_batches, schedule.value, tuple(events))
