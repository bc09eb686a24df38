"""`pipeline`: the stages of `model_parallel`, fed micro-batches.

GPipe or 1F1B schedules overlap the stages (`PipelinedModel` of
`tfmgpu.parallel.pipeline`); gradients are accumulated over the
micro-batches and applied once, so training equals unsplit training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
    virtual_stages: `V` non-consecutive stages per device (interleaved
      1F1B, `schedule="1f1b"`, `micro_batches` a multiple of the stages'
      devices): the model is cut into `num_stages * V` stages, stage `k`
      on device `k % num_stages`; the bubble shrinks by `V`, the sends
      between devices grow by `V`.
  """
  micro_batches: int = setting(4, "Micro-batches per step for 'pipeline'.",
                               lower_bound=1)
  schedule: str = setting("gpipe", "Pipeline schedule.",
                          choices=SCHEDULE_CHOICES)
  recompute: bool = setting(
      False, "Pipeline: recompute activations in the backward.")
  virtual_stages: int = setting(
      1, "Pipeline: stages per device, interleaved 1F1B (needs "
      "--schedule=1f1b and micro_batches a multiple of num_stages); the "
      "model is cut into num_stages x virtual_stages stages.",
      lower_bound=1)

  def __post_init__(self):
    super().__post_init__()
    checks.check_positive("micro_batches", self.micro_batches)
    checks.check_choice("schedule", self.schedule, SCHEDULE_CHOICES)
    checks.check_positive("virtual_stages", self.virtual_stages)
    if self.virtual_stages > 1:
      from tfmgpu.parallel import schedule  # pylint: disable=g-import-not-at-top
      schedule.check_interleaved(self.stages, self.virtual_stages,
                                 self.micro_batches, self.schedule)
      if self.split_points:
        raise ValueError(
            f"virtual_stages={self.virtual_stages} cuts the model into "
            "num_stages x virtual_stages stages itself; split_points="
            f"{list(self.split_points)} cannot be combined with it. Drop one.")
      if self.tensor_parallel > 1:
        raise ValueError(
            f"virtual_stages={self.virtual_stages} with tensor_parallel="
            f"{self.tensor_parallel} is not built (interleaved stages split "
            "over tensor devices are not placed). Use --virtual_stages=1 "
            "with --tensor_parallel, or --tensor_parallel=1.")


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
                               recompute=options.recompute,
                               virtual_stages=options.virtual_stages)

  def plan(self, model: Any, options: PipelineOptions,
           devices: Sequence[str] | None = None, *,
           input_shape: Any = None) -> Any:
    """As `model_parallel`'s; with `virtual_stages=V`, `num_stages * V`
    stages whose devices repeat the first `num_stages` in order."""
    v = options.virtual_stages
    if v == 1:
      return super().plan(model, options, devices, input_shape=input_shape)
    from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
    from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
    homes = list(devices if devices is not None else
                 self.stage_homes(options)
                 or devices_lib.accelerator_devices())[:options.stages]
    chunks = options.stages * v
    return partition.plan_stages(
        model, chunks, criterion=options.partition,
        devices=[homes[k % len(homes)] for k in range(chunks)],
        check_devices=False, input_shape=input_shape)

  def check_config(self, options: PipelineOptions,
                   run: registry.RunFacts) -> None:
    super().check_config(options, run)
    model_parallel.check_stage_count(
        dataclasses.replace(options, num_stages=options.stages *
                            options.virtual_stages, virtual_stages=1,
                            schedule="gpipe"), run.model, run.model_size)

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    from tfmgpu.parallel import schedule  # pylint: disable=g-import-not-at-top
    o = placement.options
    bubble = schedule.theoretical_bubble(o.stages, o.micro_batches,
                                         o.virtual_stages)
    virtual = (f", {o.virtual_stages} stages per device (interleaved)"
               if o.virtual_stages > 1 else "")
    return super().describe(placement) + [
        ("pipeline", f"{o.micro_batches} micro-batches, {o.schedule} "
         f"schedule{virtual}{', recompute' if o.recompute else ''}, bubble "
         f"{bubble:.0%} (ideal stages)")]
