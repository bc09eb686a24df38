"""`pipeline`: the stages of `model_parallel`, fed micro-batches.

GPipe or 1F1B schedules overlap the stages (`PipelinedModel` of
`tfmgpu.parallel.pipeline`); gradients are accumulated over the
micro-batches and applied once, so training equals unsplit training.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmgpu import checks
from tfmgpu.parallel.choices import SCHEDULE_CHOICES
from tfmgpu.placements import model_parallel
from tfmgpu.settings import setting
from tfmgpu.strategies import registry


@dataclasses.dataclass(frozen=True)
class PipelineOptions(model_parallel.StageOptions):
  """Stages plus how micro-batches flow through them.

  Attributes:
    micro_batches: micro-batches per step; the global batch must divide.
    schedule: `gpipe` or `1f1b`.
    recompute: recompute activations in the backward (less memory).
  """
  micro_batches: int = setting(4, "Micro-batches per step for 'pipeline'.",
                               lower_bound=1)
  schedule: str = setting("gpipe", "Pipeline schedule.",
                          choices=SCHEDULE_CHOICES)
  recompute: bool = setting(
      False, "Pipeline: recompute activations in the backward.")

  def __post_init__(self):
    super().__post_init__()
    checks.check_positive("micro_batches", self.micro_batches)
    checks.check_choice("schedule", self.schedule, SCHEDULE_CHOICES)


@registry.register
class Pipeline(model_parallel.ModelParallel):
  """Stages on separate devices, overlapped by micro-batches."""
  name = "pipeline"
  python_api = "tfmgpu.PipelinedModel"
  description = ("Pipeline parallelism: stages on separate devices fed "
                 "micro-batches (GPipe or 1F1B schedule), overlapping stages; "
                 "gradients accumulated and applied once (PipelinedModel).")
  needs = ("2+ devices (GPUs, or logical CPUs for testing), a chain-like "
           "Sequential/functional model and a batch divisible by "
           "micro_batches")
  Options = PipelineOptions
  concurrent_devices = True

  def micro_batches(self, options: PipelineOptions) -> int:
    return options.micro_batches

  def layout_of(self, options: PipelineOptions) -> Any:
    return dataclasses.replace(super().layout_of(options),
                               schedule=options.schedule,
                               recompute=options.recompute)

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    from tfmgpu.parallel import schedule  # pylint: disable=g-import-not-at-top
    o = placement.options
    bubble = schedule.theoretical_bubble(o.stages, o.micro_batches)
    return super().describe(placement) + [
        ("pipeline", f"{o.micro_batches} micro-batches, {o.schedule} "
         f"schedule{', recompute' if o.recompute else ''}, bubble "
         f"{bubble:.0%} (ideal stages)")]
