"""`Trainer(model, zero_stage=N)`: the model sharded over the replicas'
devices (ZeRO, `tfmgpu.parallel.zero.ShardedModel`), as
`--strategy=mirrored --zero_stage=N` does from the command line.

The devices are those of the strategy the Trainer is given (a
`MirroredStrategy`'s replicas; a model built in its scope has its mirrored
variables moved to one owner each), or, under TF's default strategy, every
device a `mirrored` run would replicate over (the GPUs, else the logical
CPUs). The sharded model then trains under the default strategy: it places
its own work.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfmgpu.parallel import placed_model
from tfmgpu.parallel import zero
from tfmgpu.strategies import replicas as replicas_lib


def shard_for_trainer(model: keras.Model, strategy: Any, stage: int
                      ) -> tuple[keras.Model, Any]:
  """`(model, strategy)` for a Trainer asked for ZeRO `stage`.

  Args:
    model: a built Keras model, or a `ShardedModel` of the same stage.
    strategy: the Trainer's strategy (`None`: the current one).
    stage: `0` (nothing sharded: returned as given), `1`, `2` or `3`.

  Returns:
    The `ShardedModel` and TF's default strategy (stage 0: as given).

  Raises:
    ValueError: an unknown stage, a model sharded at another stage, a
      call inside a strategy's scope, or a strategy that spans several
      workers (one host only).
  """
  stage = zero.check_stage(stage)
  if isinstance(model, zero.ShardedModel):
    if stage and model.stage != stage:
      raise ValueError(f"zero_stage={stage} but model {model.name!r} is "
                       f"already sharded at stage {model.stage}: pass "
                       f"zero_stage={model.stage} (or 0), or shard the "
                       "unsplit model.")
    return model, strategy
  if not stage:
    return model, strategy
  if placed_model.is_placed(model):  # Re-homing its variables would undo
    raise ValueError(  # its placement.
        f"zero_stage={stage} shards a model's variables over data-parallel "
        f"devices, but model {model.name!r} is already placed over devices "
        f"({type(model).__name__}). Shard the unsplit model (e.g. "
        "`model.to_unsplit()`), or train the placed one with zero_stage=0.")
  if tf.distribute.has_strategy():
    raise ValueError(
        f"zero_stage={stage}: create the Trainer outside `strategy.scope()`"
        " (each variable then moves to one owner; inside the scope TF would "
        "mirror it again). Build the model in the scope if you like, then "
        "call tfmgpu.Trainer(model, strategy=strategy, zero_stage=...) "
        "after the `with` block.")
  if replicas_lib.in_multi_worker_mode(
      strategy or tf.distribute.get_strategy()):
    raise ValueError(
        f"zero_stage={stage}: strategy {type(strategy).__name__} spans "
        "several workers, each running its own program, and keeps a whole "
        "copy on each. Across workers ZeRO runs in-graph, one client "
        "driving every task's devices: python -m tfmgpu.train "
        f"--strategy=multi_worker_mirrored --zero_stage={stage} (under "
        "python -m tfmgpu.launch or TF_CONFIG), or in Python "
        "tf.config.experimental_connect_to_cluster(...) then "
        "tfmgpu.parallel.ShardedModel(model, <every task's devices>, "
        "stage=...). On one host: a MirroredStrategy (or none).")
  given = strategy is not None
  strategy = strategy or tf.distribute.get_strategy()
  if given and not isinstance(strategy, type(tf.distribute.get_strategy())):
    devices = list(strategy.extended.worker_devices)  # Its own devices.
  else:  # No strategy (or TF's default): every local device.
    devices = replicas_lib.select_replica_devices(None, None, None)
  return (zero.ShardedModel(model, devices, stage=stage),
          tf.distribute.get_strategy())
