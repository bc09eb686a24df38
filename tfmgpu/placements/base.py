"""The base of the layout placements, and what every placement shares.

A layout is `R` data-parallel copies of `K` stages, each stage's split
layers sharded over `T` devices (`tfmgpu.parallel.hybrid`). `LayoutOptions`
declares the sizes every layout takes (`data_parallel`, `tensor_parallel`,
`tensor_rules`) and what follows from them (`stages`, `devices_needed`,
`label`); `LayoutPlacement` is the distribution that places, serves,
describes, checks and plans any layout, so that `model_parallel`,
`pipeline` and `tensor_parallel` are presets of it: their options, how
they cut the model (`plan`) and what they add to the summary.

The functions below are what every placement shares: building the unsplit
model on the host (`build_unsplit`, `build_for_plan`), the one Keras model
a placement serves (`one_model`, `keras_models_only`) and the devices of a
plan for another machine (`planned_devices`).

Importing this module does not import TensorFlow: engines load when a
placement builds, serves or plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

from absl import logging

from tfmgpu import checks
from tfmgpu._lazy import LazyModule
from tfmgpu.parallel import layout as layout_lib
from tfmgpu.settings import Record
from tfmgpu.settings import setting
from tfmgpu.strategies import registry

tf = LazyModule("tensorflow")


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
  """The sizes of a layout: `R` copies, each split layer over `T` devices.

  Attributes:
    data_parallel: `R`, data-parallel copies, each on its own devices,
      gradients summed per group of devices holding the same part.
    tensor_parallel: `T`, devices each split layer is sharded over.
    tensor_rules: which layers split and how, `"regex=kind,..."` with kinds
      `column`, `row`, `heads` (`None`: the GPT rules).
  """
  data_parallel: int = setting(
      1, "Data-parallel copies of the staged model (model_parallel, "
      "pipeline) or of the sharded one (tensor_parallel); the layout uses "
      "data_parallel x stages x tensor_parallel devices.", lower_bound=1,
      record=Record.SIZE)
  tensor_parallel: int = setting(
      1, "Devices each split layer is sharded over (Megatron-style: "
      "attention by heads, MLP by columns then rows), for model_parallel, "
      "pipeline and tensor_parallel.", lower_bound=1, record=Record.SIZE)
  tensor_rules: str | None = setting(
      None, "Which layers --tensor_parallel splits, as 'regex=kind,...' on "
      "layer names (kinds: column, row, heads), or 'layout_map': a keras_hub "
      "model's own layout map (its attention and MLP kernels inside the "
      "blocks). Default: the layout map for keras_hub models (gpt2, llama, "
      "...), else the gpt rules (*_attention=heads, *_mlp_up=column, "
      "*_mlp_down=row).",
      record=Record.SIZE)

  def __post_init__(self):
    checks.check_positive("data_parallel", self.data_parallel)
    checks.check_positive("tensor_parallel", self.tensor_parallel)

  @property
  def stages(self) -> int:
    """`K`, stages per copy: 1 unless the layout cuts the model."""
    return 1

  @property
  def hybrid(self) -> bool:
    """The layout copies (data) or shards (tensor) what it places."""
    return self.data_parallel > 1 or self.tensor_parallel > 1

  @property
  def sizes(self) -> layout_lib.Layout:
    """The layout's sizes (no micro-batches: see `layout_of`)."""
    return layout_lib.Layout(data=self.data_parallel, stages=self.stages,
                             tensor=self.tensor_parallel)

  @property
  def devices_needed(self) -> int:
    return self.sizes.num_devices

  @property
  def label(self) -> str:
    """`data 2 x stages 2 x tensor 2`, as the summary prints it."""
    return self.sizes.label


class LayoutPlacement(registry.Distribution):
  """A layout of copies, stages and shards, built by `hybrid.build_layout`.

  A preset sets the class attributes and `Options` (a `LayoutOptions`),
  and overrides what differs: `plan` (how the model is cut; `None`: not
  cut), `micro_batches`, `layout_of`, `size_row`, `check_config`.
  """
  kind = registry.Kind.PLACEMENT
  Options = LayoutOptions
  # The layout's devices are the first `devices_needed` found even without
  # copies or shards (else a plain stage layout takes its plan's devices).
  always_layout_devices = False

  # ------------------------------------------------------------- the layout

  def micro_batches(self, options: Any) -> int | None:
    """Micro-batches per step of each copy (`None`: stages in turn)."""
    del options
    return None

  def layout_of(self, options: Any) -> Any:
    """The `tfmgpu.parallel.layout.Layout` of `options`."""
    return dataclasses.replace(options.sizes,
                               micro_batches=self.micro_batches(options))

  def uses_layout_devices(self, options: Any) -> bool:
    """Whether the layout takes the first `devices_needed` devices found."""
    return self.always_layout_devices or options.hybrid

  def layout_devices(self, options: Any) -> list[str] | None:
    """The layout's devices (`None`: the plan's)."""
    if not self.uses_layout_devices(options):
      return None
    from tfmgpu import devices  # pylint: disable=g-import-not-at-top
    return devices.accelerator_devices()[:options.devices_needed]

  def stage_homes(self, options: Any) -> list[str] | None:
    """The first copy's stage devices (each stage's first shard), where
    the plan puts the stages; `None`: the plan's own."""
    found = self.layout_devices(options)
    if found is None:
      return None
    from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
    return hybrid.stage_homes(self.layout_of(options).mesh(found)[0])

  def plan(self, model: Any, options: Any, devices: Sequence[str] | None = None,
           *, input_shape: Any = None) -> Any:
    """The `StagePlan` that cuts `model` (`None`: the layout cuts nothing);
    on `devices` if given, else the stage homes."""
    del model, options, devices, input_shape
    return None

  def split(self, model: Any, plan: Any, options: Any) -> Any:
    """The placed model: `model` cut along `plan`, copied and sharded."""
    from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
    return hybrid.build_layout(model, self.layout_of(options),
                               devices=self.layout_devices(options),
                               plan=plan, rules=tensor_rules(options))

  # --------------------------------------------------- training and serving

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    del strategy, seed  # Layouts run under the default strategy.
    model = build_unsplit(build)
    plan = self.plan(model, options)
    placed = self.split(model, plan, options)
    return registry.Placement(
        tf.distribute.get_strategy(), list(placed.devices), placed, plan,
        distribution=self, options=options,
        costs=self.costs_of(model, plan, options, list(placed.devices)))

  def costs_of(self, model: Any, plan: Any, options: Any,
               devices: Sequence[str]) -> Any:
    """The placed layout's `accounting.LayoutCosts` (replica 0's devices
    first in `devices`), for the run summary's predicted step; `None` (and
    a log line) when the cost model cannot cost the model."""
    from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
    layout = self.layout_of(options)
    try:
      return accounting.layout_costs(
          model, layout, plan=plan, rules=tensor_rules(options),
          devices=list(devices)[:layout.stages * layout.tensor])
    except (ValueError, TypeError, KeyError) as e:
      logging.info("No predicted step for this layout: %s", e)
      return None

  def serve(self, models: Sequence[Any], options: Any) -> tuple[Any, Any]:
    model = served_view(one_model(self.name, models))
    return self.split(model, self.plan(model, options), options), None

  def save_model(self, model: Any, path: str) -> str:
    """Saves the unsplit model (`placed_model.unsplit_of`)."""
    from tfmgpu.parallel import placed_model  # pylint: disable=g-import-not-at-top
    return super().save_model(placed_model.unsplit_of(model), path)

  # ------------------------------------------------------- rules and reports

  def check_config(self, options: Any, run: registry.RunFacts) -> None:
    check_layout_sizes(options, self.micro_batches(options),
                       global_batch_size=run.global_batch_size,
                       virtual_devices=run.virtual_devices)

  def size_row(self, placement: registry.Placement) -> tuple[str, str]:
    """The summary's first row of a copied or sharded layout."""
    raise NotImplementedError

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    o = placement.options
    shares = [f"{w.path} (stages {', '.join(map(str, w.stages))})"
              for w in (placement.plan.shared if placement.plan else ())]
    shared_rows = [("shared weights", "; ".join(shares) + ": one variable "
                    "on its first stage, gradients summed")] if shares else []
    if not self.uses_layout_devices(o):
      return super().describe(placement) + shared_rows
    return [self.size_row(placement),
            ("layout", o.label + f" on {o.devices_needed} devices "
             "(replica-major, tensor shards innermost): "
             + ", ".join(placement.devices))] + shared_rows

  def plan_text(self, model: Any, options: Any, *, global_batch_size: int,
                optimizer: str, input_shape: Any = None) -> str | None:
    """The stage plan and its per-device memory table; for a copied or
    sharded layout, the bytes each kind of parallelism sends and its step
    projected on an 8-GPU host (`tfmgpu.parallel.accounting`); for a causal
    LM, then the weights and KV cache of serving it (`serving_text`)."""
    if self.uses_layout_devices(options):
      text, plan, names = self._layout_text(model, options,
                                            global_batch_size, optimizer)
    else:
      text, plan = self._stage_text(model, options, global_batch_size,
                                    optimizer, input_shape)
      names = list(plan.devices)
    serving = serving_text(model, self.layout_of(options), global_batch_size,
                           input_shape, rules=tensor_rules(options),
                           plan=plan, devices=names)
    return text if serving is None else f"{text}\n\n{serving}"

  def _stage_text(self, model: Any, options: Any, global_batch_size: int,
                  optimizer: str, input_shape: Any) -> tuple[str, Any]:
    from tfmgpu import devices  # pylint: disable=g-import-not-at-top
    planned = planned_devices(options.stages)
    plan = self.plan(model, options, planned, input_shape=input_shape)
    layout = self.layout_of(options)
    table = plan.memory_table(
        global_batch_size, optimizer=optimizer,
        micro_batches=layout.micro_batches or 1, schedule=layout.schedule,
        recompute=layout.recompute)
    lines = [str(plan), "", table]
    if planned:
      lines.append(f"(A plan for {len(planned)} devices; this machine has "
                   f"{len(devices.accelerator_devices())}.)")
    return "\n".join(lines), plan

  def _layout_text(self, model: Any, options: Any, global_batch_size: int,
                   optimizer: str) -> tuple[str, Any, list[str]]:
    from tfmgpu import devices  # pylint: disable=g-import-not-at-top
    from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
    layout = self.layout_of(options)
    names = (planned_devices(layout.num_devices) or
             devices.accelerator_devices())[:layout.stages * layout.tensor]
    plan = (self.plan(model, options, names[::layout.tensor])
            if layout.stages > 1 else None)
    account = accounting.account(
        model, layout, global_batch_size=global_batch_size,
        optimizer=optimizer, rules=tensor_rules(options), devices=names,
        plan=plan)
    table = accounting.format_layout_table(account, "dgx_a100")
    return (table if plan is None else f"{plan}\n\n{table}"), plan, names


def serving_text(model: Any, layout: Any, global_batch_size: int,
                 input_shape: Any, *, rules: Any = None, plan: Any = None,
                 devices: Any = None) -> str | None:
  """For a causal LM, the weights and KV cache per device of serving the
  global batch at the sequence length (`input_shape[0]`) in `layout`
  (`kv_cache.plan_section`); `None` for other models."""
  from tfmgpu.parallel import kv_cache  # pylint: disable=g-import-not-at-top
  context = (int(input_shape[0]) if input_shape and len(input_shape) == 1
             and input_shape[0] else None)
  return kv_cache.plan_section(model, layout, batch=global_batch_size,
                               context=context, rules=rules, plan=plan,
                               devices=devices)


def check_layout_sizes(options: LayoutOptions, micro_batches: int | None, *,
                       global_batch_size: int,
                       virtual_devices: int | None) -> None:
  """Rules of a layout's sizes against the rest of a run's settings.

  Args:
    options: the layout's options.
    micro_batches: micro-batches per copy (a pipeline), else `None`.
    global_batch_size: examples per step.
    virtual_devices: the logical devices the run makes (`None`: those found).

  Raises:
    ValueError: the global batch does not divide over the data-parallel
      copies and their micro-batches, or `virtual_devices` makes fewer
      devices than the layout needs.
  """
  replicas, micro = options.data_parallel, micro_batches or 1
  what = [f"data_parallel={replicas}"] if replicas > 1 else []
  what += [f"micro_batches={micro}"] if micro_batches else []
  if what:
    checks.check_divisible("global_batch_size", global_batch_size,
                           replicas * micro, " x ".join(what))
  needed, have = options.devices_needed, virtual_devices
  if have is not None and have < needed:
    raise ValueError(
        f"virtual_devices={have} is fewer than the {needed} devices of "
        f"data_parallel={replicas} x stages={options.stages} x "
        f"tensor_parallel={options.tensor_parallel}. Use --virtual_devices="
        f"{needed}, or smaller sizes.")


def tensor_rules(options: LayoutOptions) -> Any:
  """The options' tensor rules, parsed (`None`: the default rules)."""
  if not options.tensor_rules:
    return None
  if options.tensor_rules == "layout_map":  # A keras_hub model's own map.
    return options.tensor_rules
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  return tensor.parse_rules(options.tensor_rules)


def build_unsplit(build: Callable[[], Any]) -> Any:
  """Builds the whole model once on the host; each part is then rebuilt on
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


def served_view(model: Any) -> Any:
  """What serving splits: `model`, or a plain functional view of it (its
  layers and weights) when its class overrides only training steps
  (`train_step`, `test_step`, `compute_loss`), which serving never runs;
  a split refuses such a model (`checks.refuse_custom_steps`)."""
  custom = checks.overridden_steps(model)
  if not custom or "predict_step" in custom:
    return model
  import keras  # pylint: disable=g-import-not-at-top
  try:
    return keras.Model(model.input, model.output, name=model.name)
  except (AttributeError, ValueError, TypeError):
    return model  # Not a graph of layers: the split says what it needs.


def one_model(name: str, models: Sequence[Any]) -> Any:
  """The single Keras model a placement serves.

  Raises:
    ValueError: several models, or one that is not a Keras model (a
      SavedModel, whose layers cannot be split).
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

