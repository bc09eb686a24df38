"""Hybrid layouts: data x pipeline x tensor parallelism from the parts.

A `Layout` (`tfmgpu.parallel.layout`, plain data without Keras) names the
three sizes: `R` data-parallel replicas, each a chain of `K` stages, each
stage's split layers sharded over `T` devices, so `R * K * T` devices in
all, ordered replica-major with the tensor shards innermost (the shards of
one layer, which talk in every block, are neighbours: on a GPU host, the
devices joined by the fastest links):

    device index = r * (K * T) + k * T + t

`build_layout(model, layout)` builds it from the engines that each do one
thing: `tensor.tensor_parallel` shards the rule-matched layers of each
stage over that stage's `T` devices, `StagedModel` / `PipelinedModel` cut
the model into stages (the first shard device of each stage runs its
unsplit layers), and `ReplicatedModel` makes `R` copies whose gradients
are summed per group of devices holding the same part. Every piece keeps
the unsplit model's layer names and presents split weights in their
unsplit form, so weights move between any two layouts through the unsplit
model (`copy_weights_to`, `load_from`, `to_unsplit`), and checkpoints do
too (`tfmgpu.training.checkpoints.restore_weights`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from absl import logging
import keras

from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import layout_maps
from tfmgpu.parallel import partition
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import replicated
from tfmgpu.parallel import staged
from tfmgpu.parallel.layout import Layout  # Re-exported: `hybrid.Layout`.


def stage_homes(grid: list[list[str]]) -> list[str]:
  """One replica's stage devices (`grid[k][t]` -> each stage's first
  shard): where a stage plan puts the stages."""
  return [shards[0] for shards in grid]


def _on_devices(plan: plan_lib.StagePlan, devices: Sequence[str]
                ) -> plan_lib.StagePlan:
  """The same cut, stage `k` on `devices[k % len(devices)]` (virtual
  stages repeat the devices in order)."""
  return dataclasses.replace(plan, stages=tuple(
      dataclasses.replace(s, device=devices[k % len(devices)])
      for k, s in enumerate(plan.stages)))


def _transform(axes: dict[str, int] | None, devices_of: Any) -> Any:
  if not axes:
    return None
  from tfmgpu.parallel import split_blocks  # pylint: disable=g-import-not-at-top
  return split_blocks.transform(axes, devices_of)


def _copy(model: keras.Model, layout: Layout, plan: plan_lib.StagePlan,
          grid: list[list[str]], rules: Any,
          axes: dict[str, int] | None = None) -> keras.Model:
  """One replica: `model` cut along `plan` and sharded over `grid[k]`."""
  if layout.tensor > 1:
    from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  homes = stage_homes(grid)
  if layout.stages == 1 and layout.tensor > 1:
    return tensor.TensorParallelModel(
        model, grid[0], rules=rules,
        transform=_transform(axes, lambda name: grid[0]))
  source = model
  if layout.tensor > 1 and (rules or axes is None):
    source = tensor.tensor_parallel(
        model, rules=rules,
        devices_for=lambda name: grid[plan.stage_of(name)])
  mine = _on_devices(plan, homes)
  if layout.micro_batches is None:
    placed = staged.StagedModel(source, mine, unsplit=model)
  else:
    placed = pipeline.PipelinedModel(
        source, mine, micro_batches=layout.micro_batches,
        schedule=layout.schedule, recompute=layout.recompute,
        virtual_stages=layout.virtual_stages, unsplit=model)
  if not axes:
    return placed
  from tfmgpu.parallel import split_blocks  # pylint: disable=g-import-not-at-top
  return split_blocks.split_stages(placed, model, axes, grid)


LAYOUT_MAP = "layout_map"  # rules= asking for the model's own layout map.


def _say_left_whole(model: keras.Model, axes: dict[str, int],
                    tensor: int) -> None:
  """Logs the Dense kernels a keras_hub model's own split leaves whole
  (Mistral's MLP gate, Phi3's attention: its map names other paths), which
  then sit whole on a stage's first device."""
  whole, fraction = layout_maps.left_whole(model, axes)
  if whole:
    logging.warning(
        "tensor=%d splits model %r by its keras_hub layout, which leaves %d "
        "Dense kernel(s) whole on the first device of each tensor group "
        "(%.0f%% of its "
        "weights): %s%s. To split them too, pass layout_map={path regex: "
        "axis} naming them with the others.", tensor, model.name, len(whole),
        100 * fraction, ", ".join(whole[:4]), " ..." if len(whole) > 4 else "")


def _split_axes(model: keras.Model, layout_map: Any, rules: Any,
                tensor: int) -> dict[str, int] | None:
  """`{variable path: axis}` of a `LayoutMap` or `{path regex: axis}`; with
  neither, a keras_hub model's own (`layout_maps.own_axes`) unless `rules`
  are given."""
  if tensor == 1 or (layout_map is None and rules not in (None, LAYOUT_MAP)):
    return None
  if layout_map is None:
    axes = layout_maps.own_axes(model, tensor)
    if axes is None and rules == LAYOUT_MAP:
      raise ValueError(
          f"tensor_rules={LAYOUT_MAP!r} asks for the model's own layout "
          f"map, but model {model.name!r} is not a keras_hub model with one. "
          "Give rules ('regex=kind,...') or a layout_map.")
    if axes == {}:
      raise layout_maps.nothing_to_split(model, tensor)
    if axes:
      _say_left_whole(model, axes, tensor)
    return axes
  if isinstance(layout_map, dict):
    axes = layout_maps.path_rules(model, layout_map)
  else:
    axes = layout_maps.split_axes(model, layout_map)
  if not axes:
    raise ValueError(
        f"layout_map={layout_map!r} splits no weight of model "
        f"{model.name!r} over its model axis; give one whose regexes match "
        "the variable paths (e.g. 'transformer_layer_0/self_attention/"
        "query/kernel').")
  return axes


def _check_one_stage(layout: Layout) -> None:
  """Refuses a layout of one stage that is plain data parallelism (no
  micro-batches) or that asks tensor shards for micro-batches (not built).
  One stage in micro-batches is gradient accumulation: each copy runs its
  share of the batch a micro-batch at a time and sums the gradients."""
  if layout.stages > 1:
    return
  if layout.tensor > 1 and layout.micro_batches not in (None, 1):
    raise ValueError(
        f"micro_batches={layout.micro_batches} with the layout "
        f"{layout.label}: tensor shards without stages do not run in "
        "micro-batches (not built). Use micro_batches=None, or stages >= 2 "
        "to pipeline the shards.")
  if layout.tensor == 1 and layout.micro_batches in (None, 1):
    raise ValueError(
        f"The layout {layout.label} is plain data parallelism: use "
        "MirroredStrategy, which runs it with TF's own all-reduce "
        "(Trainer(model, strategy='mirrored') with the model built in "
        "tfmgpu.get_strategy('mirrored').scope(); CLI: "
        "--strategy=mirrored). To accumulate gradients over micro-batches "
        "of each copy's batch (activations of one micro-batch at a time), "
        "give micro_batches=N >= 2 with schedule='1f1b' (CLI: "
        "--strategy=pipeline --num_stages=1 --micro_batches=N "
        "--schedule=1f1b --data_parallel=R).")


def _stage_plan(model: keras.Model, layout: Layout,
                plan: plan_lib.StagePlan | None, homes: Sequence[str], *,
                criterion: str, split_points: Sequence[str] | None
                ) -> plan_lib.StagePlan | None:
  """`plan`, checked, or one made: `stages * virtual_stages` stages on the
  first replica's stage devices, repeating in order."""
  chunks = layout.stages * layout.virtual_stages
  _check_one_stage(layout)
  if plan is None and (layout.stages > 1 or layout.tensor == 1):
    return partition.plan_stages(
        model, chunks, criterion=criterion, split_points=split_points,
        devices=[homes[k % layout.stages] for k in range(chunks)])
  if plan is not None and plan.num_stages != chunks:
    raise ValueError(
        f"plan has {plan.num_stages} stages but the layout {layout.label} "
        f"with virtual_stages={layout.virtual_stages} asks for {chunks}.")
  return plan


def build_layout(model: keras.Model, layout: Layout, *,
                 devices: Sequence[str] | None = None,
                 plan: plan_lib.StagePlan | None = None,
                 criterion: str = "balanced",
                 split_points: Sequence[str] | None = None,
                 rules: Any = None, layout_map: Any = None) -> keras.Model:
  """`model` laid out as `layout` on `devices`, holding `model`'s weights.

  Args:
    model: the unsplit, built Keras model (left untouched).
    layout: the sizes (`Layout`).
    devices: at least `layout.num_devices` devices, in mesh order (see the
      module docstring). Defaults to the plan's devices for stages alone,
      else the accelerators found.
    plan: how to cut the model into `layout.stages` stages (the devices it
      names are replaced by each replica's); made by `plan_stages` with
      `criterion` / `split_points` when `None`.
    criterion, split_points: as for `tfmgpu.parallel.plan_stages`.
    rules: which layers split over `T` devices and how
      (`tfmgpu.parallel.tensor`); `"layout_map"`: the model's own layout map
      (keras_hub). Defaults to the model's own split for a keras_hub model
      (`layout_maps.own_axes`), else the GPT rules; none with `layout_map`.
    layout_map: which weights split, by variable path, even inside blocks
      (`tfmgpu.parallel.layout_maps`): a `keras.distribution.LayoutMap`
      (e.g. keras_hub's `LlamaBackbone.get_layout_map(mesh)`: its model
      axis is the tensor dimension, its batch axis the data dimension), or
      `{path regex: axis}` (`{"feedforward_output_dense/kernel": 0}`).
      Dense / EinsumDense kernels split along the axis given; a token
      embedding's table along axis 0 (vocabulary-parallel, with the LM head
      it serves reversed), without stages only.

  Returns:
    A placed Keras model: a `ReplicatedModel` of the copies when
    `layout.data > 1`, else the one copy (`StagedModel`, `PipelinedModel`
    or `TensorParallelModel`).

  Raises:
    ValueError: too few devices, a plan for another number of stages,
      plain data parallelism (1 stage, 1 shard, no micro-batches: use
      `MirroredStrategy`), micro-batches of shards without stages, or a
      model overriding a Keras step (`train_step`, ...).
  """
  checks.refuse_custom_steps(model)  # Before planning: fail fast.
  checks.refuse_stateful_layers(model, f"in the layout {layout.label}")
  layout_maps.warn_if_keras_distribution("build_layout")
  if devices is None and plan is not None and layout.num_devices == \
      layout.stages:  # Stages alone: where the plan puts them.
    devices = plan.devices
  found = list(devices) if devices is not None else \
      devices_lib.accelerator_devices()
  mesh = layout.mesh(devices_lib.resolve_devices(found[:layout.num_devices]))
  plan = _stage_plan(model, layout, plan, stage_homes(mesh[0]),
                     criterion=criterion, split_points=split_points)
  axes = _split_axes(model, layout_map, rules, layout.tensor)
  if axes is not None and rules in (None, LAYOUT_MAP):
    rules = {}
  copies = [_copy(model, layout, plan, grid, rules, axes) for grid in mesh]
  if layout.data == 1:
    return copies[0]
  return replicated.ReplicatedModel(copies)
