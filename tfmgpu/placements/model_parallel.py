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
    data_parallel: `R` data-parallel copies of the staged model, each on its
      own devices, gradients summed per stage group
      (`tfmgpu.parallel.hybrid`).
    tensor_parallel: `T` devices each stage's split layers are sharded over
      (`tfmgpu.parallel.tensor`); the layout uses `R * stages * T` devices.
    tensor_rules: which layers split and how, `"regex=kind,..."` with kinds
      `column`, `row`, `heads` (`None`: the GPT rules).
  """
  num_stages: int = 2
  partition: str = "balanced"
  split_points: tuple[str, ...] | None = None
  data_parallel: int = 1
  tensor_parallel: int = 1
  tensor_rules: str | None = None

  def __post_init__(self):
    checks.check_positive("num_stages", self.num_stages)
    checks.check_positive("data_parallel", self.data_parallel)
    checks.check_positive("tensor_parallel", self.tensor_parallel)
    checks.check_choice("partition", self.partition, PARTITION_CHOICES)
    if self.split_points is not None:
      object.__setattr__(self, "split_points", tuple(self.split_points))

  @property
  def stages(self) -> int:
    """The number of stages these options make."""
    return len(self.split_points) + 1 if self.split_points else self.num_stages

  @property
  def hybrid(self) -> bool:
    """The stages are also copied (data) or sharded (tensor)."""
    return self.data_parallel > 1 or self.tensor_parallel > 1

  @property
  def devices_needed(self) -> int:
    return self.data_parallel * self.stages * self.tensor_parallel


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
             devices: Sequence[str] | None = None, *,
             input_shape: Any = None):
  """The `StagePlan` that `options` ask for; on `devices` if given (names
  only, not checked: a plan for another machine); `input_shape` is the
  data's, for a model that leaves its sequence length unknown."""
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  split = list(options.split_points) if options.split_points else None
  return partition.plan_stages(model, options.stages,
                               criterion=options.partition,
                               split_points=split, devices=devices,
                               check_devices=False, input_shape=input_shape)


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
  python_api = "tfmgpu.StagedModel"
  description = ("Model parallelism: consecutive layer stages on separate "
                 "devices, each stage's forward and backward on its own "
                 "device (StagedModel).")
  kind = registry.Kind.PLACEMENT
  needs = ("2+ devices (GPUs, or logical CPUs for testing) and a chain-like "
           "Sequential/functional model")
  Options = StageOptions
  concurrent_devices = False  # Stages run one after another.
  layout = "stages"

  micro_batches_of = staticmethod(lambda options: None)  # Stages in turn.

  def split(self, model: Any, plan: Any, options: Any) -> Any:
    """The placed model for `plan` (copied and sharded if the options ask)."""
    from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
    return hybrid.build_layout(
        model, layout_of(options, self.micro_batches_of(options)),
        devices=layout_devices(options), plan=plan,
        rules=tensor_rules(options))

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    del strategy, seed  # Stages run under the default strategy.
    model = build_unsplit(build)
    plan = plan_for(model, options, stage_homes(options))
    placed = self.split(model, plan, options)
    devices = getattr(placed, "devices", None) or list(plan.devices)
    return registry.Placement(
        tf.distribute.get_strategy(), list(devices), placed, plan,
        distribution=self, options=options)

  def serve(self, models: Sequence[Any], options: Any) -> tuple[Any, Any]:
    model = one_model(self.name, models)
    plan = plan_for(model, options, stage_homes(options))
    return self.split(model, plan, options), None

  def check_config(self, config: Any) -> None:
    options = self.options_from(config)
    check_layout_config(config, options, self.micro_batches_of(options))
    check_stage_count(config, options)

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    o = placement.options
    shares = [f"{w.path} (stages {', '.join(map(str, w.stages))})"
              for w in getattr(placement.plan, "shared", ())]
    shared_rows = [("shared weights", "; ".join(shares) + ": one variable "
                    "on its first stage, gradients summed")] if shares else []
    if not getattr(o, "hybrid", False):
      return super().describe(placement) + shared_rows
    homes = ", ".join(placement.plan.devices) if placement.plan else "?"
    return [(self.layout, f"{o.stages} per replica; replica 0's on {homes}"),
            ("layout", hybrid_label(o) + f" on {o.devices_needed} devices "
             "(replica-major, tensor shards innermost): "
             + ", ".join(placement.devices))] + shared_rows


def check_layout_config(config: Any, options: Any,
                        micro_batches: int | None = None) -> None:
  """Rules of a layout's sizes against the rest of a run's settings.

  Args:
    config: the run's `TrainConfig`.
    options: the layout's options (`StageOptions` or the tensor placement's:
      `data_parallel`, `tensor_parallel`, `stages`, `devices_needed`).
    micro_batches: micro-batches per copy (a pipeline), else `None`.

  Raises:
    ValueError: the global batch does not divide over the data-parallel
      copies and their micro-batches, or `--virtual_devices` makes fewer
      devices than the layout needs.
  """
  replicas, micro = options.data_parallel, micro_batches or 1
  what = [f"data_parallel={replicas}"] if replicas > 1 else []
  what += [f"micro_batches={micro}"] if micro_batches else []
  if what:
    checks.check_divisible("global_batch_size", config.global_batch_size,
                           replicas * micro, " x ".join(what))
  needed, have = options.devices_needed, config.virtual_devices
  if have is not None and have < needed:
    raise ValueError(
        f"virtual_devices={have} is fewer than the {needed} devices of "
        f"data_parallel={replicas} x stages={options.stages} x "
        f"tensor_parallel={options.tensor_parallel}. Use --virtual_devices="
        f"{needed}, or smaller sizes.")


def check_stage_count(config: Any, options: Any) -> None:
  """More stages than a registered model has cuttable blocks, refused
  before TensorFlow loads (as `parallel.partition` would once it is built).

  Raises:
    ValueError: `num_stages` above the model's declared block count.
  """
  if options.split_points:
    return
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  blocks = models.cuttable_blocks(config.model, config.model_size)
  if blocks is not None and options.num_stages > blocks:
    raise ValueError(
        f"num_stages={options.num_stages} but model {config.model!r} has "
        f"only {blocks} cuttable block(s) (one per layer call; a stage "
        f"needs at least one). Use num_stages<={blocks}.")


def layout_of(options: Any, micro_batches: int | None) -> Any:
  """The `tfmgpu.parallel.hybrid.Layout` of stage (or tensor) options."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  return hybrid.Layout(
      data=getattr(options, "data_parallel", 1),
      stages=getattr(options, "stages", 1),
      tensor=getattr(options, "tensor_parallel", 1),
      micro_batches=micro_batches,
      schedule=getattr(options, "schedule", "gpipe"),
      recompute=getattr(options, "recompute", False))


def hybrid_label(options: Any) -> str:
  """`data 2 x stages 2 x tensor 2`, as the summary prints it."""
  return (f"data {getattr(options, 'data_parallel', 1)} x stages "
          f"{getattr(options, 'stages', 1)} x tensor "
          f"{getattr(options, 'tensor_parallel', 1)}")


def layout_devices(options: Any) -> list[str] | None:
  """The devices of the layout: the first `R * K * T` found (`None` for a
  plain stage placement, which takes the plan's)."""
  if not getattr(options, "hybrid", False):
    return None
  from tfmgpu import devices  # pylint: disable=g-import-not-at-top
  return devices.accelerator_devices()[:options.devices_needed]


def stage_homes(options: Any) -> list[str] | None:
  """The first replica's stage devices (each stage's first shard), where
  the plan puts the stages; `None` for a plain stage placement."""
  found = layout_devices(options)
  if found is None:
    return None
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  return hybrid.stage_homes(layout_of(options, None).mesh(found)[0])


def tensor_rules(options: Any) -> Any:
  """The options' tensor rules, parsed (`None`: the default rules)."""
  text = getattr(options, "tensor_rules", None)
  if not text:
    return None
  if text == "layout_map":  # The keras_hub model's own (parallel.hybrid).
    return text
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  return tensor.parse_rules(text)
