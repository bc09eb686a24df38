"""ZeRO stages weighed by `--strategy=auto` (`tfmgpu.parallel.auto`).

A plain data-parallel candidate (`mirrored n=R`, `R >= 2`) gets one variant
per ZeRO stage: the same compute and activations, the weights, gradients
and slots of the device holding the most under that stage
(`zero_memory.account_model`, whole variables owned by bytes), and the
all-reduce's time scaled by the bytes the stage's busiest device sends
against the all-reduce's (stage 3 reads each weight once per step: about
the all-reduce's bytes, not DeepSpeed's 1.5x). A stage is chosen when it
is the fastest layout that fits: when whole copies do not.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfmgpu.parallel import zero_memory

STAGES = (1, 2, 3)


def zero_variants(model: Any, candidates: Sequence[Any], hardware: Any,
                  optimizer: str | int) -> list[Any]:
  """Stages 1-3 of each plain data-parallel candidate.

  Args:
    model: the Keras model weighed (weights or shapes only).
    candidates: `auto.Candidate`s of `mirrored` (others are skipped).
    hardware: the `accounting.Hardware` (its memory budget).
    optimizer: optimizer name or slots per trainable weight.

  Returns:
    One candidate per stage and plain data-parallel candidate of `R >= 2`
    replicas, its `zero_stage` set.
  """
  out = []
  for c in candidates:
    if c.strategy != "mirrored" or c.devices < 2 or c.zero_stage:
      continue
    names = [f"/device:{hardware.device_kind}:{i}" for i in range(c.devices)]
    plain = max(zero_memory.account_model(model, names, 0, optimizer),
                key=lambda r: r.total)
    held = c.account.peak.memory if c.account is not None else None
    state = (held.weights + held.gradients + held.optimizer_slots
             if held is not None else plain.total)
    for stage in STAGES:
      rows = zero_memory.account_model(model, names, stage, optimizer)
      top = max(rows, key=lambda r: r.total)
      sent = max(r.sent for r in rows)
      memory = c.memory_bytes - state + top.total
      out.append(dataclasses.replace(
          c, zero_stage=stage, memory_bytes=memory,
          fits=memory <= hardware.memory_bytes,
          comm_s=c.comm_s * sent / max(plain.sent, 1),
          sent_bytes=c.sent_bytes - plain.sent + sent))
  return out
