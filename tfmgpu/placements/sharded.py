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

from typing import Any, Callable

from tfmgpu._lazy import LazyModule
from tfmgpu.strategies import data_parallel
from tfmgpu.strategies import registry
from tfmgpu.strategies.replicas import select_replica_devices
from tfmgpu.strategies.replicas import short_device

tf = LazyModule("tensorflow")
zero = LazyModule("tfmgpu.parallel.zero")


def place_sharded(distribution: registry.Distribution, options: Any,
                  build: Callable[[], Any]) -> registry.Placement:
  """Builds the model on the host and shards it over the replica devices.

  Args:
    distribution: `mirrored`.
    options: its `MirroredOptions` (`zero_stage` >= 1; the devices).
    build: builds the unsplit model.

  Returns:
    A `Placement` of a `ShardedModel` under TF's default strategy.
  """
  devices = select_replica_devices(options.devices, options.num_gpus,
                                   options.num_replicas)
  with tf.device("/cpu:0"):  # Host memory; each variable then moves.
    model = build()
  sharded = zero.ShardedModel(model, devices, stage=options.zero_stage)
  return registry.Placement(tf.distribute.get_strategy(),
                            [short_device(d) for d in devices], sharded,
                            distribution=distribution, options=options)


data_parallel.register_sharded_placement(place_sharded)
