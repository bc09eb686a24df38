"""`mirrored --zero_stage=1|2|3`: the replicas' state sharded over their
devices (ZeRO, `tfmgpu.parallel.zero.ShardedModel`).

`mirrored` stays one name: with `zero_stage` it asks this module (through
`data_parallel.register_sharded_placement`, the strategies layer naming no
engine) to build the model on the host, move each variable to its owner
among the replica devices and train it under TF's default strategy, the
model placing its own work.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from tfmgpu import in_graph
from tfmgpu._lazy import LazyModule
from tfmgpu.parallel import placed_model
from tfmgpu.placements import base
from tfmgpu.strategies import data_parallel
from tfmgpu.strategies import registry
from tfmgpu.strategies.replicas import select_replica_devices
from tfmgpu.strategies.replicas import short_device

tf = LazyModule("tensorflow")
zero = LazyModule("tfmgpu.parallel.zero")


def place_sharded(distribution: registry.Distribution, options: Any,
                  build: Callable[[], Any], *,
                  devices: Sequence[str] | None = None
                  ) -> registry.Placement:
  """Builds the model on the host and shards it over the replica devices.

  Args:
    distribution: `mirrored` or `multi_worker_mirrored`.
    options: its options (`zero_stage` >= 1; `mirrored`'s choose the
      devices).
    build: builds the unsplit model.
    devices: the replica devices (`multi_worker_mirrored`: every task's,
      `tfmgpu.in_graph.replica_devices`); default: `mirrored`'s.

  Returns:
    A `Placement` of a `ShardedModel` under TF's default strategy.
  """
  if devices is None:
    devices = select_replica_devices(options.devices, options.num_gpus,
                                     options.num_replicas)
  with tf.device("/cpu:0"):  # Host memory; each variable then moves.
    model = build()
  sharded = zero.ShardedModel(model, devices, stage=options.zero_stage)
  return registry.Placement(tf.distribute.get_strategy(),
                            [short_device(d) for d in devices], sharded,
                            distribution=distribution, options=options)


def plan_sharded(model: Any, options: Any, optimizer: str) -> str:
  """`--plan_only` of `--zero_stage=N`: per-device weights,
  gradients, optimizer slots and bytes sent of plain mirrored and of stage
  N (`tfmgpu.parallel.zero_memory`), on the replica devices the run would
  use (or as many as it names, on a machine that has fewer)."""
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero_memory  # pylint: disable=g-import-not-at-top
  if not hasattr(options, "devices"):  # multi_worker_mirrored: TF_CONFIG's.
    devices = in_graph.planned_devices()
  else:
    devices = list(options.devices or ())
  if not devices:
    count = (options.num_replicas or options.num_gpus
             or len(devices_lib.accelerator_devices()))
    devices = (base.planned_devices(count)
               or devices_lib.accelerator_devices()[:count])
  rows = {stage: zero_memory.account_model(model, devices, stage, optimizer)
          for stage in sorted({0, options.zero_stage})}
  return zero_memory.format_table(rows, optimizer)


data_parallel.register_sharded_placement(
    place_sharded, plan_sharded, placed_model.unsplit_of)
