"""Pipeline schedules: the order in which each stage runs its micro-batch work.

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

Interleaved 1F1B (`virtual_stages=V > 1`, Megatron-LM's schedule): the
model is cut into `K * V` stages ("chunks") and device `d` holds the
non-consecutive chunks `d, d + K, d + 2K, ...`; `device_orders` gives each
device its chunks' tasks in Megatron's order (groups of `K` micro-batches
through each chunk in turn; `(K - d - 1) * 2 + (V - 1) * K` warm-up
forwards, then one forward, one backward). `M` must be a multiple of `K`.
Each chunk is `1 / V` of a stage, so the bubble shrinks by `V`:
`(K - 1) / (V * M + K - 1)` with equal times, at the price of `V` times
more sends between devices.

`PipelinedModel` builds its graph from these orders, and
`tfmgpu.parallel.timeline.simulate` predicts the timeline of the same orders
from per-stage forward/backward times. With equal stage times the bubble (the
idle share of the step) is the textbook `(K - 1) / (M + K - 1)`
(`theoretical_bubble`).

The schedule names are `tfmgpu.parallel.choices.SCHEDULE_CHOICES`; `Schedule`
is their typed view.

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Callable

from tfmgpu.parallel import choices

FORWARD = "forward"
BACKWARD = "backward"


class Schedule(str, enum.Enum):
  """The order in which each stage runs its micro-batches.

  Its values are `choices.SCHEDULE_CHOICES`, in that order.
  """
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
  if schedule not in choices.SCHEDULE_CHOICES:
    raise ValueError(
        f"schedule={schedule!r} is unknown. Choose one of "
        f"{', '.join(map(repr, choices.SCHEDULE_CHOICES))}.")
  return Schedule(schedule)


def check_counts(num_stages: int, micro_batches: int) -> None:
  """Raises ValueError unless both counts are positive ints."""
  for key, value in (("num_stages", num_stages),
                     ("micro_batches", micro_batches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{key}={value!r} must be an int >= 1 (e.g. "
                       f"{key}=4).")


def theoretical_bubble(num_stages: int, micro_batches: int,
                       virtual_stages: int = 1) -> float:
  """The idle share `(K - 1) / (V * M + K - 1)` of a pipeline of `K` equal
  devices (`V`: chunks per device, interleaved 1F1B; 1 otherwise)."""
  check_counts(num_stages, micro_batches)
  check_counts(virtual_stages, 1)
  return (num_stages - 1) / (virtual_stages * micro_batches + num_stages - 1)


def check_virtual_stages(virtual_stages: int) -> int:
  """Returns `virtual_stages`; raises ValueError unless it is an int >= 1."""
  if (isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int)
      or virtual_stages < 1):
    raise ValueError(f"virtual_stages={virtual_stages!r} must be an int >= 1 "
                     "(e.g. 2: two non-consecutive stages per device).")
  return virtual_stages


def check_interleaved(num_devices: int, virtual_stages: int,
                      micro_batches: int, schedule: str | Schedule) -> None:
  """Raises ValueError unless interleaving `virtual_stages` chunks per device
  is possible: a count >= 1, `"1f1b"` when above 1, and `micro_batches` a
  multiple of `num_devices`."""
  check_virtual_stages(virtual_stages)
  if virtual_stages == 1:
    return
  if check_schedule(schedule) is not Schedule.ONE_F_ONE_B:
    raise ValueError(f"virtual_stages={virtual_stages} interleaves 1F1B; "
                     f"schedule={schedule!r} cannot. Use schedule='1f1b' or "
                     "virtual_stages=1.")
  if micro_batches % num_devices:
    raise ValueError(
        f"micro_batches={micro_batches} must be a multiple of the "
        f"{num_devices} devices for interleaved 1F1B (virtual_stages="
        f"{virtual_stages}); use e.g. micro_batches="
        f"{-(-micro_batches // num_devices) * num_devices}.")


def device_orders(num_devices: int, micro_batches: int,
                  schedule: str | Schedule = "gpipe", *,
                  virtual_stages: int = 1) -> list[list[Task]]:
  """The tasks each device runs, in its order.

  With `virtual_stages=1` a device is a stage (`stage_orders`). Otherwise
  device `d` runs the chunks `d + v * K` (`v < V`; a task's `stage` is its
  chunk) in interleaved 1F1B order (see the module docstring).

  Raises:
    ValueError: see `check_interleaved`.
  """
  check_counts(num_devices, micro_batches)
  check_interleaved(num_devices, virtual_stages, micro_batches, schedule)
  if virtual_stages == 1:
    return stage_orders(num_devices, micro_batches, schedule)
  K, V, M = num_devices, virtual_stages, micro_batches
  total = M * V

  def task(d: int, i: int, forward: bool) -> Task:
    group, position = divmod(i, K * V)  # `i`-th forward (backward) of `d`.
    v = position // K if forward else V - 1 - position // K
    return Task(v * K + d, group * K + position % K,
                FORWARD if forward else BACKWARD)

  orders = []
  for d in range(K):
    warmup = total if M == K else min((K - d - 1) * 2 + (V - 1) * K, total)
    order = [task(d, i, True) for i in range(warmup)]
    for i in range(total - warmup):
      order += [task(d, warmup + i, True), task(d, i, False)]
    orders.append(order + [task(d, i, False)
                           for i in range(total - warmup, total)])
  return orders


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
