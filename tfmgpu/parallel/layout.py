"""The sizes of a hybrid layout: data x pipeline x tensor parallelism.

A `Layout` is plain data, importable without Keras or TensorFlow: the
planners that weigh layouts (`serve_plan`, `accounting`) and the
placements that name one (`Distribution.layout_of`) use it, and
`tfmgpu.parallel.hybrid.build_layout` builds it (`hybrid.Layout` is this
class). Devices are ordered replica-major with the tensor shards innermost:

    device index = r * (K * T) + k * T + t
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfmgpu.parallel import schedule as schedule_lib


@dataclasses.dataclass(frozen=True)
class Layout:
  """The sizes of a hybrid layout.

  Attributes:
    data: `R`, data-parallel replicas.
    stages: `K`, pipeline (or model-parallel) stages per replica.
    tensor: `T`, devices each split layer is sharded over.
    micro_batches: micro-batches per step of each replica's pipeline;
      `None` runs the stages one after another (model parallelism).
    schedule: the pipeline's schedule, `gpipe` or `1f1b`.
    recompute: recompute activations in the pipeline's backward.
    virtual_stages: `V` non-consecutive stages per device (interleaved
      1F1B): the plan then has `stages * V` stages, stage `k` on the
      device of stage `k % stages`.
  """
  data: int = 1
  stages: int = 1
  tensor: int = 1
  micro_batches: int | None = None
  schedule: str = "gpipe"
  recompute: bool = False
  virtual_stages: int = 1

  def __post_init__(self):
    for name in ("data", "stages", "tensor", "virtual_stages"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1.")
    if self.virtual_stages > 1:
      self._check_interleaved()

  def _check_interleaved(self) -> None:
    """Interleaved 1F1B as built: a pipeline of 2+ stages, no tensor split
    (its chunks' shards are not placed), and what `schedule.check_interleaved`
    asks of the schedule and the micro-batch count."""
    v = f"virtual_stages={self.virtual_stages}"
    if self.stages < 2 or self.micro_batches is None:
      raise ValueError(
          f"{v} interleaves a pipeline's stages, but the layout has "
          f"stages={self.stages}, micro_batches={self.micro_batches}: use "
          "stages >= 2 with micro_batches, or virtual_stages=1.")
    if self.tensor > 1:
      raise ValueError(
          f"{v} with tensor={self.tensor} is not built: interleaved stages "
          "split over tensor devices are not placed. Use virtual_stages=1 "
          "with tensor parallelism, or tensor=1.")
    schedule_lib.check_interleaved(self.stages, self.virtual_stages,
                                   self.micro_batches, self.schedule)

  @property
  def num_devices(self) -> int:
    return self.data * self.stages * self.tensor

  @property
  def label(self) -> str:
    """E.g. `data 2 x stages 2 x tensor 2` (`, 2 virtual stages each`)."""
    virtual = (f", {self.virtual_stages} virtual stages each"
               if self.virtual_stages > 1 else "")
    return (f"data {self.data} x stages {self.stages} x tensor "
            f"{self.tensor}{virtual}")

  def mesh(self, devices: Sequence[str]) -> list[list[list[str]]]:
    """`mesh[r][k][t]`: the device of replica `r`, stage `k`, shard `t`."""
    if len(devices) < self.num_devices:
      raise ValueError(
          f"The layout {self.label} needs {self.num_devices} devices but "
          f"{len(devices)} are given ({list(devices)}). Use fewer replicas, "
          "stages or shards, or more devices (--virtual_devices on CPU).")
    k, t = self.stages, self.tensor
    return [[[devices[r * k * t + s * t + i] for i in range(t)]
             for s in range(k)] for r in range(self.data)]
