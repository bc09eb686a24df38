"""A projection (not a measurement) of data-parallel training on N GPUs.

Each replica all-reduces one gradient per weight every step
(`gradient_bytes`); a ring all-reduce moves 2(N-1)/N times those bytes over
each GPU's link. `project_data_parallel` adds that time to a measured
compute time per step, with no overlap of communication and computation.
`project_layout` predicts the step of a hybrid layout (data x pipeline x
tensor) on a named GPU host with the hybrid cost model
(`tfmgpu.parallel.accounting`), whose data all-reduce is the same ring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmgpu.parallel import accounting
from tfmgpu.parallel import links


def gradient_bytes(model: keras.Model, dtype: str = "float32") -> int:
  """Bytes each replica all-reduces per step (one gradient per weight)."""
  size = tf.as_dtype(dtype).size
  return sum(int(np.prod(v.shape)) for v in model.trainable_variables) * size


# Unidirectional per-GPU link bandwidth in GB/s (nominal; real all-reduce
# bus bandwidth is typically 70-90% of these): `tfmgpu.parallel.links`.
LINK_PRESETS = links.GPU_LINKS


@dataclasses.dataclass(frozen=True)
class Projection:
  """A projected (not measured) data-parallel step on an N-GPU host."""
  num_gpus: int
  link: str
  compute_ms: float
  allreduce_ms: float

  @property
  def step_ms(self) -> float:
    return self.compute_ms + self.allreduce_ms

  @property
  def scaling_efficiency(self) -> float:
    """Fraction of ideal N-fold speed-up (1.0 = perfect)."""
    return self.compute_ms / self.step_ms


def project_data_parallel(compute_ms: float, grad_bytes: int, num_gpus: int,
                          link: str = "pcie4") -> Projection:
  """Projects step time with ring all-reduce: 2(N-1)/N x bytes / bandwidth.

  Assumes no overlap of communication with the backward pass (a pessimistic
  bound) and the same per-GPU batch (weak scaling).
  """
  if link not in LINK_PRESETS:
    raise ValueError(f"link={link!r} is unknown. Choose one of "
                     f"{', '.join(LINK_PRESETS)}.")
  if num_gpus < 1:
    raise ValueError(f"num_gpus={num_gpus} must be >= 1.")
  comm_s = (2 * (num_gpus - 1) / num_gpus * grad_bytes /
            (LINK_PRESETS[link] * 1e9))
  return Projection(num_gpus, link, compute_ms, comm_s * 1e3)


@dataclasses.dataclass(frozen=True)
class LayoutProjection:
  """A layout's predicted (not measured) step on a named GPU host.

  Attributes:
    host: the `links.GPU_HOSTS` name.
    step: the predicted step, by part (`accounting.StepTime`).
    peak_bytes: memory of the layout's fullest device.
    memory_bytes: memory of each of the host's GPUs.
  """
  host: str
  step: accounting.StepTime
  peak_bytes: int
  memory_bytes: int

  @property
  def step_ms(self) -> float:
    return self.step.total_s * 1e3

  @property
  def fits(self) -> bool:
    """The fullest device fits in a GPU's memory (by the estimate)."""
    return self.peak_bytes <= self.memory_bytes


def project_layout(model: keras.Model, layout: Any, *, global_batch_size: int,
                   host: str = "dgx_a100") -> LayoutProjection:
  """Predicts `layout`'s training step of `model` on `host` GPUs.

  The hybrid cost model (`tfmgpu.parallel.accounting.account`): compute at
  the host's sustained FLOP/s, the tensor all-reduces over its link, the
  pipeline's bubble by simulation, then the data all-reduce (a ring, as
  `project_data_parallel`), nothing overlapped; Adam's slots in memory.

  Args:
    model: a built Keras model (weight shapes suffice:
      `tfmgpu.parallel.graph.shapes_only`).
    layout: a `tfmgpu.parallel.hybrid.Layout` (data, stages, tensor,
      micro-batches, schedule, recompute).
    global_batch_size: examples per step over all replicas.
    host: a `links.GPU_HOSTS` name; as many hosts as the layout needs.
  """
  acc = accounting.account(model, layout, global_batch_size=global_batch_size)
  hosts = math.ceil(layout.num_devices / links.host(host).gpus)
  hardware = accounting.host_hardware(host, hosts)
  return LayoutProjection(host, acc.step(hardware), acc.peak.memory.total,
                          hardware.memory_bytes)
