"""Per-device memory and bytes sent of ZeRO stages 0-3 (`--plan_only`).

For `R` data-parallel devices, each variable owned by one of them
(`zero.assign_owners`, balanced by bytes), a device holds:

| stage | weights | summed gradients | optimizer slots |
|---|---|---|---|
| 0 (`mirrored`) | all | all | all |
| 1 | all trainable, its own non-trainable | all | its own |
| 2 | all trainable, its own non-trainable | its own | its own |
| 3 | its own | its own | its own |

("its own": the variables it owns, about `1/R` of the bytes.) Stage 1's
gradients are counted whole, as DeepSpeed's stage 1 keeps them; tfmgpu's
stage 1 runs stage 2's step, where a step's gradients are graph tensors
freed once sent to their owner. Non-trainable weights (batch-norm
statistics) live on their owners from stage 1 on.

Bytes each device sends per step: stage 0 a ring all-reduce of the
gradients, `2 (R - 1) / R * G`; stages 1-3 the gradients it does not own
to their owners (`G - own`) and its own weights to the `R - 1` others
(`(R - 1) * own`: stages 1 and 2 after the update, stage 3 for the forward,
whose received weights TF keeps for the backward), on average the bytes of
the all-reduce. Activations are not counted (the same in every stage).

Importing this module does not import TensorFlow; `account_model` reads a
Keras model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfmgpu.parallel import plan as plan_lib
from tfmgpu.strategies.options import ZERO_STAGES

_fmt_bytes = plan_lib._fmt_bytes  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True)
class ZeroDevice:
  """One data-parallel device under a ZeRO stage: bytes it holds and sends.

  Attributes:
    device: its name.
    weights, gradients, slots: bytes held (gradients: the summed ones the
      update reads).
    sent: bytes it sends per step.
  """
  device: str
  weights: int
  gradients: int
  slots: int
  sent: int

  @property
  def total(self) -> int:
    return self.weights + self.gradients + self.slots


def owners_of(sizes: Sequence[int], num_devices: int) -> list[int]:
  """`zero.assign_owners`, without importing TensorFlow."""
  loads = [0] * num_devices
  owners = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    device = min(range(num_devices), key=lambda d: (loads[d], d))
    owners[i] = device
    loads[device] += sizes[i]
  return owners


def account(sizes: Sequence[int], trainable: Sequence[bool],
            devices: Sequence[str], stage: int, optimizer: str | int
            ) -> list[ZeroDevice]:
  """Each device's bytes under `stage` (see the module docstring).

  Args:
    sizes: bytes of each variable of the model (weights, in one order).
    trainable: whether each is trainable.
    devices: the `R` data-parallel devices.
    stage: 0, 1, 2 or 3.
    optimizer: an optimizer name of `plan.OPTIMIZER_SLOTS`, or the slots
      per trainable weight.

  Returns:
    One `ZeroDevice` per device, in the order of `devices`.
  """
  if stage not in ZERO_STAGES:
    raise ValueError(f"zero_stage={stage!r} is not one of {ZERO_STAGES}.")
  slots_per = plan_lib._optimizer_slots(optimizer)  # pylint: disable=protected-access
  r = len(devices)
  owners = owners_of(sizes, r)
  grads = sum(s for s, t in zip(sizes, trainable) if t)
  rows = []
  for d, name in enumerate(devices):
    own_t = sum(s for s, t, o in zip(sizes, trainable, owners)
                if t and o == d)
    own_all = sum(s for s, o in zip(sizes, owners) if o == d)
    if stage == 0:
      rows.append(ZeroDevice(name, sum(sizes), grads, slots_per * grads,
                             int(2 * (r - 1) / r * grads)))
      continue
    weights = own_all if stage == 3 else grads + own_all - own_t
    rows.append(ZeroDevice(
        name, weights, grads if stage == 1 else own_t, slots_per * own_t,
        (grads - own_t) + (r - 1) * own_t))
  return rows


def account_model(model: Any, devices: Sequence[str], stage: int,
                  optimizer: str | int) -> list[ZeroDevice]:
  """`account` of a built Keras model's weights."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  seen, sizes, trainable = set(), [], []
  for v in model.weights:
    if id(v) in seen:
      continue
    seen.add(id(v))
    sizes.append(int(tf.TensorShape(v.shape).num_elements() or 0)
                 * tf.as_dtype(v.dtype).size)
    trainable.append(bool(v.trainable))
  return account(sizes, trainable, devices, stage, optimizer)


def format_table(rows_by_stage: dict[int, list[ZeroDevice]],
                 optimizer: str | int) -> str:
  """Per-device bytes of each stage, side by side with plain mirrored."""
  lines = [f"ZeRO: per-device bytes held and sent per step "
           f"({len(next(iter(rows_by_stage.values())))} data-parallel "
           f"devices, optimizer {optimizer}; activations not counted)"]
  header = ("stage", "device", "weights", "gradients", "slots", "total",
            "sent/step")
  table = [header]
  for stage, rows in rows_by_stage.items():
    for row in rows:
      table.append((str(stage), row.device, _fmt_bytes(row.weights),
                    _fmt_bytes(row.gradients), _fmt_bytes(row.slots),
                    _fmt_bytes(row.total), _fmt_bytes(row.sent)))
  widths = [max(len(r[i]) for r in table) for i in range(len(header))]
  for r in table:
    lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
  return "\n".join(lines)
