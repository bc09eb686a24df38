"""`model_parallel`: consecutive layer stages, each on its own device.

Each stage's forward and backward run on its device (`StagedModel` of
`tfmgpu.parallel.staged`); the stage plan comes from the partitioner
(`tfmgpu.parallel.partition.plan_stages`) or from explicit split points.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from absl import logging

from tfmgpu import checks
from tfmgpu._lazy import LazyModule
from tfmgpu.parallel.choices import PARTITION_CHOICES
from tfmgpu.strategies import registry

tf = LazyModule("tensorflow")


@dataclasses.dataclass(frozen=True)
class StageOptions:
  """How a model is cut into stages.

  Attributes:
    num_stages: stages (one device each); ignored when `split_points` is set.
    partition: the cost stages are balanced by: `balanced`, `params`,
      `flops`.
    split_points: explicit stage boundaries (layer names): each named layer
      starts a new stage.
  """
  num_stages: int = 2
  partition: str = "balanced"
  split_points: tuple[str, ...] | None = None

  def __post_init__(self):
    checks.check_positive("num_stages", self.num_stages)
    checks.check_choice("partition", self.partition, PARTITION_CHOICES)
    if self.split_points is not None:
      object.__setattr__(self, "split_points", tuple(self.split_points))

  @property
  def stages(self) -> int:
    """The number of stages these options make."""
    return len(self.split_points) + 1 if self.split_points else self.num_stages


def build_unsplit(build: Callable[[], Any]) -> Any:
  """Builds the whole model once on the host; each stage is then rebuilt on
  its own device (building it on GPU:0 would defeat the split)."""
  with tf.device("/cpu:0"):
    return build()


def build_for_plan(build: Callable[[], Any]) -> Any:
  """Builds a model for its plan only: its layers and weight shapes, no
  weight values (`tfmgpu.parallel.graph.shapes_only`: a `gpt2_xl` plans in
  seconds, without its 6 GB). A builder that fails so is built for real."""
  from tfmgpu.parallel import graph  # pylint: disable=g-import-not-at-top
  try:
    return graph.shapes_only(lambda: build_unsplit(build))
  except ImportError as e:  # Keras moved the private state it relies on.
    logging.warning("Cannot build the model with weight shapes only (%s); "
                    "building it with its weights for the plan.", e)
  except (ValueError, TypeError, RuntimeError, AttributeError):
    pass  # It needs weight values (or its shapes are wrong: said below).
  return build_unsplit(build)


def planned_devices(num_stages: int) -> list[str] | None:
  """Device names for a plan of `num_stages` when fewer accelerators exist
  here (`/device:GPU:0`, ... or CPU), else `None` (the devices found)."""
  from tfmgpu import devices  # pylint: disable=g-import-not-at-top
  found = devices.accelerator_devices()
  if len(found) >= num_stages:
    return None
  kind = "GPU" if any("GPU" in d for d in found) else "CPU"
  return [f"/device:{kind}:{i}" for i in range(num_stages)]


def plan_for(model: Any, options: StageOptions,
             devices: Sequence[str] | None = None):
  """The `StagePlan` that `options` ask for; on `devices` if given (names
  only, not checked: a plan for another machine)."""
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  split = list(options.split_points) if options.split_points else None
  return partition.plan_stages(model, options.stages,
                               criterion=options.partition,
                               split_points=split, devices=devices,
                               check_devices=False)


def one_model(name: str, models: Sequence[Any]) -> Any:
  """The single Keras model a stage placement serves.

  Raises:
    ValueError: several models, or one that is not a Keras model (a
      SavedModel, whose layers cannot be split into stages).
  """
  if len(models) != 1:
    raise ValueError(f"{name} serves one model; got {len(models)}.")
  keras_models_only(name, models)
  return models[0]


def keras_models_only(name: str, models: Sequence[Any]) -> None:
  """Placements split or clone Keras models: refuse anything else, named."""
  import keras  # pylint: disable=g-import-not-at-top
  for model in models:
    if not isinstance(model, keras.Model):
      what = getattr(model, "path", None) or repr(model)
      raise ValueError(
          f"strategy={name!r} places the layers of a Keras model on devices, "
          f"but {what} is a SavedModel, whose layers are not Keras layers. "
          "Give its .keras file (training saves MODEL_DIR/model.keras), or "
          "serve the SavedModel with a data-parallel strategy (e.g. "
          "--strategy=mirrored), which runs it on every replica.")


@registry.register
class ModelParallel(registry.Distribution):
  """Stages on separate devices, run one after another."""
  name = "model_parallel"
  description = ("Model parallelism: consecutive layer stages on separate "
                 "devices, each stage's forward and backward on its own "
                 "device (StagedModel).")
  kind = registry.Kind.PLACEMENT
  needs = ("2+ devices (GPUs, or logical CPUs for testing) and a chain-like "
           "Sequential/functional model")
  Options = StageOptions
  concurrent_devices = False  # Stages run one after another.
  layout = "stages"

  def split(self, model: Any, plan: Any, options: Any) -> Any:
    """The placed model for `plan`."""
    del options
    from tfmgpu.parallel import staged  # pylint: disable=g-import-not-at-top
    return staged.StagedModel(model, plan)

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    del strategy, seed  # Stages run under the default strategy.
    model = build_unsplit(build)
    plan = plan_for(model, options)
    return registry.Placement(
        tf.distribute.get_strategy(), list(plan.devices),
        self.split(model, plan, options), plan, distribution=self,
        options=options)

  def serve(self, models: Sequence[Any], options: Any) -> tuple[Any, Any]:
    model = one_model(self.name, models)
    return self.split(model, plan_for(model, options), options), None
