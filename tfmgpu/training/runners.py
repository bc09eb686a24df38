"""Step runners: "run up to n steps and return their sums".

A runner is what the `Controller` (`tfmgpu.training.controller`) drives.
`SyncRunner` calls a compiled `strategy.run` function
(`tfmgpu.training.distributed`) once per call, reading its batches from a
`tf.data` iterator or from device-resident arrays
(`tfmgpu.training.resident`). The parameter-server runner lives beside its
trainer in `tfmgpu.training.parameter_server`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu.training import resident
from tfmgpu.training.controller import StepSums


def to_sums(out: dict[str, Any], steps: int) -> StepSums:
  """A train function's result (tensors) as host floats."""
  return StepSums(steps=steps, loss=float(out["loss"]),
                  correct=float(out["correct"]), count=float(out["count"]),
                  non_finite=float(out["non_finite"]))


class SyncRunner:
  """Synchronous steps under `strategy.run`, `steps_per_execution` per call.

  Each replica sees exactly the examples of `tfmgpu.data.input_fn`'s order
  (seeded by `seed` and the epoch), from either source, so a resumed run
  skips exactly the steps already done.

  Args:
    train_fn: from `distributed.make_train_function` (its `device_data`
      must match `device_data` here).
    strategy: the strategy `train_fn` runs under.
    x, y: the training arrays.
    global_batch_size: examples per step over all replicas.
    steps_per_execution: steps per call.
    seed, shuffle: the epoch order.
    device_data: gather batches from arrays held on each replica's device
      instead of a `tf.data` iterator.
  """

  coordinator_only = False

  def __init__(self, train_fn: Callable[..., dict[str, tf.Tensor]],
               strategy: tf.distribute.Strategy, x: np.ndarray, y: np.ndarray,
               *, global_batch_size: int, steps_per_execution: int,
               seed: int, shuffle: bool, steps_per_epoch: int,
               device_data: bool):
    self.train_fn = train_fn
    self.strategy = strategy
    self.x, self.y = x, y
    self.global_batch_size = global_batch_size
    self.steps_per_execution = steps_per_execution
    self.seed, self.shuffle = seed, shuffle
    self.steps_per_epoch = steps_per_epoch
    self.device_data = device_data
    self._held: resident.DeviceData | None = None
    self._source: Any = None

  def start_epoch(self, epoch: int, first_step: int) -> None:
    if not self.device_data:
      self._source = iter(self._epoch_dataset(epoch, first_step))
      return
    if self._held is None:  # Copied once, when there is an epoch to train.
      self._held = resident.DeviceData(self.strategy, self.x, self.y)
    self._source = self._held.epoch(
        global_batch_size=self.global_batch_size, steps=self.steps_per_epoch,
        seed=self.seed, epoch=epoch, shuffle=self.shuffle)

  def run(self, done: int, limit: int) -> StepSums:
    n = min(self.steps_per_execution, limit)
    source = self._source.from_step(done) if self.device_data else self._source
    return to_sums(self.train_fn(source, tf.constant(n)), n)

  def _epoch_dataset(self, epoch: int, first_step: int):
    """The epoch's distributed dataset, from step `first_step` on (resume)."""
    x, y, shuffle = self.x, self.y, self.shuffle
    if first_step:
      # The rest of the same order: with `input_fn`'s interleaved sharding,
      # each global batch is a contiguous slice of the epoch's order.
      order = data_lib.epoch_indices(len(x), seed=self.seed, epoch=epoch,
                                     shuffle=shuffle)
      rest = order[first_step * self.global_batch_size:]
      x, y, shuffle = x[rest], y[rest], False
    return data_lib.distribute(
        self.strategy, x, y, global_batch_size=self.global_batch_size,
        shuffle=shuffle, seed=self.seed, epoch=epoch, drop_remainder=True)
