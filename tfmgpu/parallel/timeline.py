"""The timeline of one pipelined step: simulated, summarised and drawn.

`simulate` predicts when each stage runs each task of a schedule
(`tfmgpu.parallel.schedule.stage_orders`) from per-stage forward/backward
times: each stage runs its tasks one at a time in the schedule's order, and
a task starts when its stage is free and its inputs have arrived. The
`Timeline` it returns (or one built from measured times) gives the start and
end of every task, the step time, per-stage busy time, the bubble fraction
(idle share of `K * step_time`), the peak activations held, an ASCII Gantt
chart (`Timeline.text`) and a matplotlib plot (`Timeline.plot`; matplotlib is
the `plots` extra and is imported only there). With equal stage times the
bubble is the textbook `(K - 1) / (M + K - 1)`
(`tfmgpu.parallel.schedule.theoretical_bubble`).

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfmgpu.parallel import schedule as schedule_lib


@dataclasses.dataclass(frozen=True)
class Event:
  """When one task ran (in the timeline's time unit)."""
  task: schedule_lib.Task
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
  virtual_stages: int = 1

  @property
  def num_devices(self) -> int:
    """Devices: `num_stages / virtual_stages` (chunk `c` on `c % K`)."""
    return self.num_stages // self.virtual_stages

  def device_of(self, stage: int) -> int:
    return stage % self.num_devices

  @property
  def step_time(self) -> float:
    """From the first start to the last end."""
    return (max(e.end for e in self.events) -
            min(e.start for e in self.events))

  @property
  def busy(self) -> list[float]:
    """Time each device (each stage, without virtual stages) spends
    running tasks."""
    out = [0.0] * self.num_devices
    for e in self.events:
      out[self.device_of(e.task.stage)] += e.end - e.start
    return out

  @property
  def bubble_fraction(self) -> float:
    """Idle share of all devices over the step: `1 - sum(busy) / (K *
    step)`."""
    total = self.num_devices * self.step_time
    return 1.0 - sum(self.busy) / total if total > 0 else 0.0

  @property
  def theoretical_bubble(self) -> float:
    return schedule_lib.theoretical_bubble(
        self.num_devices, self.micro_batches, self.virtual_stages)

  @property
  def peak_in_flight(self) -> list[int]:
    """Per device, most micro-batches of activations held at once (a
    micro-batch counted once per chunk that holds it)."""
    return [schedule_lib.peak_in_flight(self.stage_events(k))
            for k in range(self.num_devices)]

  def stage_events(self, stage: int) -> list[schedule_lib.Task]:
    """The tasks of one device (one stage without virtual stages), by start
    time."""
    events = sorted((e for e in self.events
                     if self.device_of(e.task.stage) == stage),
                    key=lambda e: (e.start, e.end))
    return [e.task for e in events]

  def summary(self) -> str:
    """Step time, per-stage busy time, bubble (predicted and textbook)."""
    busy = ", ".join(f"{b:.4g}" for b in self.busy)
    virtual = (f" V={self.virtual_stages}" if self.virtual_stages > 1
               else "")
    formula = "(K-1)/(V*M+K-1)" if virtual else "(K-1)/(M+K-1)"
    return (f"{self.schedule}: K={self.num_devices}{virtual} "
            f"M={self.micro_batches} step={self.step_time:.4g} "
            f"busy=[{busy}] bubble={self.bubble_fraction:.3f} "
            f"(theory {formula}={self.theoretical_bubble:.3f})")

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
    for k in range(self.num_devices):
      mine = [e for e in self.events if self.device_of(e.task.stage) == k]
      cells = []
      for c in range(width):
        t = start + (c + 0.5) * span / width
        hit = next((e for e in mine if e.start <= t < e.end), None)
        if hit is None:
          cells.append(".")
        elif hit.task.kind == schedule_lib.FORWARD:
          cells.append(str(hit.task.micro_batch % 10))
        else:
          cells.append(chr(ord("a") + hit.task.micro_batch % 26))
      rows.append(f"stage {k:<2d} |{''.join(cells)}|")
    legend = ("digit m: forward of micro-batch m; letter: its backward "
              "(a=0, b=1, ...); '.': idle")
    return "\n".join([self.summary()] + rows + [legend])

  def plot(self, path: str) -> str:
    """Draws the timeline as a PNG (needs matplotlib, the `plots` extra).

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
          "Timeline.plot needs matplotlib, the plots extra of tfmgpu: "
          "pip install 'tfmgpu[plots]' (or pip install matplotlib). "
          "Timeline.text() draws the same chart without it.") from e
    fig, ax = plt.subplots(figsize=(10, 0.6 * self.num_devices + 1.2))
    for e in self.events:
      forward = e.task.kind == schedule_lib.FORWARD
      row = self.device_of(e.task.stage)
      ax.broken_barh([(e.start, e.end - e.start)], (row - 0.4, 0.8),
                     facecolors="tab:blue" if forward else "tab:orange",
                     edgecolors="black", linewidth=0.5)
      ax.text((e.start + e.end) / 2, row,
              f"{'F' if forward else 'B'}{e.task.micro_batch}",
              ha="center", va="center", fontsize=7)
    ax.set_yticks(range(self.num_devices))
    ax.set_yticklabels([f"stage {k}" for k in range(self.num_devices)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(self.summary(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _devices(num_stages: int, virtual_stages: int) -> int:
  """The devices `num_stages` chunks of `virtual_stages` each make."""
  if num_stages % schedule_lib.check_virtual_stages(virtual_stages):
    raise ValueError(f"{num_stages} stage times do not make virtual_stages="
                     f"{virtual_stages} chunks per device; give K * V times.")
  return num_stages // virtual_stages


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


def _times(forward_times, backward_times, num_stages: int | None,
           **delays: float) -> tuple[list[float], list[float]]:
  """The per-stage forward and backward times, checked with `delays`."""
  fwd = _per_stage(forward_times, num_stages, "forward_times")
  bwd = _per_stage(backward_times, num_stages or len(fwd), "backward_times")
  if len(bwd) != len(fwd):
    raise ValueError(f"forward_times has {len(fwd)} stages but "
                     f"backward_times has {len(bwd)}.")
  for name, value in delays.items():
    if not value >= 0:
      raise ValueError(f"{name}={value} must be >= 0.")
  return fwd, bwd


def _sends(task: schedule_lib.Task, num_stages: int, devices: int) -> int:
  """1 if `task`'s output goes to another device (a forward to the next
  stage, a backward to the previous one), else 0."""
  forward = task.kind == schedule_lib.FORWARD
  to = task.stage + (1 if forward else -1)
  if not 0 <= to < num_stages:
    return 0
  return int(to % devices != task.stage % devices)


def simulate(forward_times: float | Sequence[float],
             backward_times: float | Sequence[float], micro_batches: int, *,
             schedule: str | schedule_lib.Schedule = "gpipe",
             num_stages: int | None = None, virtual_stages: int = 1,
             transfer_time: float = 0.0, send_time: float = 0.0,
             concurrency: float | None = None) -> Timeline:
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
    num_stages: `K`, needed when both times are single numbers (with
      `virtual_stages`, the number of chunks, `K * V`).
    virtual_stages: `V` chunks per device, interleaved 1F1B: the times are
      per chunk, chunk `c` runs on device `c % K` (`K = stages / V`), and
      each device runs its chunks' tasks one at a time. Defaults to `1`.
    transfer_time: delay of every activation or gradient sent between
      stages (the link's; its sender is free meanwhile). Defaults to `0`.
    send_time: time the sending device itself spends on every activation
      or gradient it sends to another device (a copy on a host's logical
      devices, a launch on a GPU), added to the task that sends. With
      `virtual_stages=V` a micro-batch crosses devices `K * V - 1` times
      each way, `V` times as often as without. Defaults to `0`.
    concurrency: devices' worth of compute the devices share (`None`: each
      computes alone): `n` tasks at once each run at `min(1, concurrency /
      n)` of their speed (`1.0`: logical devices taking turns on one CPU;
      `tfmgpu.parallel.calibration` measures it). Defaults to `None`.

  Returns:
    The `Timeline`.

  Raises:
    ValueError: negative or mismatched times, `micro_batches < 1`, or an
      unknown schedule.
  """
  fwd, bwd = _times(forward_times, backward_times, num_stages,
                    transfer_time=transfer_time, send_time=send_time)
  K = len(fwd)
  schedule = schedule_lib.check_schedule(schedule)
  devices = _devices(K, virtual_stages)
  orders = schedule_lib.device_orders(devices, micro_batches, schedule,
                                      virtual_stages=virtual_stages)
  deps = lambda t: schedule_lib.dependencies(t, K, micro_batches, schedule)
  costs = {t: (fwd if t.kind == schedule_lib.FORWARD else bwd)[t.stage]
           + send_time * _sends(t, K, devices) for o in orders for t in o}
  if concurrency is not None and not concurrency > 0:
    raise ValueError(f"concurrency={concurrency!r} must be > 0 (or None).")
  events = (_shared(orders, deps, costs, transfer_time, concurrency)
            if concurrency is not None and concurrency < devices
            else _in_order(orders, deps, costs, transfer_time))
  return Timeline(K, micro_batches, schedule.value, tuple(events),
                  virtual_stages)


def _in_order(orders: Sequence[Sequence[schedule_lib.Task]], deps,
              costs: dict[schedule_lib.Task, float], transfer_time: float
              ) -> list[Event]:
  """`simulate`'s timeline of devices that compute alone."""
  devices = len(orders)
  end: dict[schedule_lib.Task, float] = {}
  free = [0.0] * devices
  events = []
  for task in schedule_lib.build_order(orders, deps):
    device = task.stage % devices
    ready = free[device]
    for d in deps(task):
      ready = max(ready, end[d] + (transfer_time if d.stage % devices
                                   != device else 0.0))
    cost = costs[task]
    end[task] = free[device] = ready + cost
    events.append(Event(task, ready, ready + cost))
  return events


def _shared(orders: Sequence[Sequence[schedule_lib.Task]], deps,
            costs: dict[schedule_lib.Task, float], transfer_time: float,
            concurrency: float) -> list[Event]:
  """`simulate`'s timeline when the devices share `concurrency` devices'
  worth of compute: between two events (a task starts or ends) each of the
  `n` running tasks progresses at `min(1, concurrency / n)`."""
  n_dev = len(orders)
  position, end = [0] * n_dev, {}
  left: list[float | None] = [None] * n_dev  # Work left of a running task.
  start, free, now, events = [0.0] * n_dev, [0.0] * n_dev, 0.0, []
  while any(p < len(o) for p, o in zip(position, orders)):
    ready = [None] * n_dev  # When each idle device can start its next task.
    for d in range(n_dev):
      if left[d] is None and position[d] < len(orders[d]):
        task = orders[d][position[d]]
        if all(x in end for x in deps(task)):
          ready[d] = max([free[d], now] + [
              end[x] + (transfer_time if x.stage % n_dev != d else 0.0)
              for x in deps(task)])
    for d in range(n_dev):
      if ready[d] is not None and ready[d] <= now:
        left[d], start[d] = costs[orders[d][position[d]]], now
    running = [d for d in range(n_dev) if left[d] is not None]
    rate = min(1.0, concurrency / len(running)) if running else 0.0
    later = [r for r in ready if r is not None and r > now]
    step = min([left[d] / rate for d in running] +
               [r - now for r in later])
    now += step
    for d in running:
      left[d] -= step * rate
      if left[d] <= 1e-15:
        task = orders[d][position[d]]
        end[task], free[d], left[d] = now, now, None
        events.append(Event(task, start[d], now))
        position[d] += 1
  return events
