"""`model_parallel`: consecutive layer stages, each on its own device.

Each stage's forward and backward run on its device (`StagedModel` of
`tfmgpu.parallel.staged`); the stage plan comes from the partitioner
(`tfmgpu.parallel.partition.plan_stages`) or from explicit split points.
A preset of `tfmgpu.placements.base.LayoutPlacement`: with
`data_parallel` / `tensor_parallel`, the stages are also copied and
sharded (`tfmgpu.parallel.hybrid`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfmgpu import checks
from tfmgpu.parallel.choices import PARTITION_CHOICES
from tfmgpu.placements import base
from tfmgpu.settings import Record
from tfmgpu.settings import setting
from tfmgpu.strategies import registry

# Shared with the placements and tools that imported them from here.
build_for_plan = base.build_for_plan
build_unsplit = base.build_unsplit
keras_models_only = base.keras_models_only
one_model = base.one_model
planned_devices = base.planned_devices


@dataclasses.dataclass(frozen=True)
class StageOptions(base.LayoutOptions):
  """How a model is cut into stages (and, as `LayoutOptions`, copied and
  sharded).

  Attributes:
    num_stages: stages (one device each); ignored when `split_points` is set.
    partition: the cost stages are balanced by: `balanced`, `params`,
      `flops`.
    split_points: explicit stage boundaries (layer names): each named layer
      starts a new stage.
  """
  num_stages: int = setting(
      2, "Stages for model_parallel/pipeline; branches for branch_parallel.",
      lower_bound=1, record=Record.VALUE)
  partition: str = setting(
      "balanced", "Cost that stages are balanced by.",
      choices=PARTITION_CHOICES, record=Record.VALUE)
  split_points: tuple[str, ...] | None = setting(
      None, "Explicit stage boundaries (layer names).", record=Record.VALUE)

  def __post_init__(self):
    super().__post_init__()
    checks.check_positive("num_stages", self.num_stages)
    checks.check_choice("partition", self.partition, PARTITION_CHOICES)
    if self.split_points is not None:
      object.__setattr__(self, "split_points", tuple(self.split_points))

  @property
  def stages(self) -> int:
    """The number of stages these options make."""
    return len(self.split_points) + 1 if self.split_points else self.num_stages


@registry.register
class ModelParallel(base.LayoutPlacement):
  """Stages on separate devices, run one after another."""
  name = "model_parallel"
  python_api = "tfmgpu.StagedModel"
  description = ("Model parallelism: consecutive layer stages on separate "
                 "devices, each stage's forward and backward on its own "
                 "device (StagedModel).")
  needs = ("2+ devices (GPUs, or logical CPUs for testing) and a chain-like "
           "Sequential/functional model")
  Options = StageOptions
  concurrent_devices = False  # Stages run one after another.
  layout = "stages"

  def plan(self, model: Any, options: StageOptions,
           devices: Sequence[str] | None = None, *,
           input_shape: Any = None) -> Any:
    """The `StagePlan` that `options` ask for; on `devices` if given (names
    only, not checked: a plan for another machine), else the stage homes;
    `input_shape` is the data's, for a model that leaves its sequence
    length unknown."""
    from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
    split = list(options.split_points) if options.split_points else None
    return partition.plan_stages(
        model, options.stages, criterion=options.partition,
        split_points=split,
        devices=devices if devices is not None else self.stage_homes(options),
        check_devices=False, input_shape=input_shape)

  def check_config(self, options: StageOptions,
                   run: registry.RunFacts) -> None:
    super().check_config(options, run)
    check_stage_count(options, run.model, run.model_size)

  def size_row(self, placement: registry.Placement) -> tuple[str, str]:
    homes = ", ".join(placement.plan.devices) if placement.plan else "?"
    return (self.layout, f"{placement.options.stages} per replica; "
            f"replica 0's on {homes}")


def check_stage_count(options: StageOptions, model: str,
                      model_size: str | None) -> None:
  """More stages than a registered model has cuttable blocks, refused
  before TensorFlow loads (as `parallel.partition` would once it is built).

  Raises:
    ValueError: `num_stages` above the model's declared block count.
  """
  if options.split_points:
    return
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  blocks = models.cuttable_blocks(model, model_size)
  if blocks is not None and options.num_stages > blocks:
    raise ValueError(
        f"num_stages={options.num_stages} but model {model!r} has "
        f"only {blocks} cuttable block(s) (one per layer call; a stage "
        f"needs at least one). Use num_stages<={blocks}.")
