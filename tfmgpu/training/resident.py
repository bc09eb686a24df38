"""Device-resident training data: each step gathers its batch on the device.

For in-memory arrays that fit, the Trainer copies the training set to every
replica's device once and hands each `tf.function` call only the epoch's
index table; each replica then gathers its batch with two `tf.gather` ops.
This takes the `tf.data` iterator, its per-step host work and (on GPUs) the
host-to-device copy out of the step. The examples each replica sees at each
step are exactly those of the `tf.data` path (`tfmgpu.training.inputs.array_dataset_fn`), so
runs, resumes and parity tests do not depend on the choice.

Supported on one host (`MirroredStrategy`, `OneDeviceStrategy`, the default
strategy); multi-worker and parameter-server training read through
`tf.data`, where each worker has its own pipeline.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from absl import logging
import numpy as np
import tensorflow as tf

from tfmgpu.training import inputs
from tfmgpu.training.choices import DEVICE_DATA_MAX_MIB
from tfmgpu.training.choices import INPUT_MODE_CHOICES

# `auto` keeps data on the devices when all the copies take at most this.
DEFAULT_MAX_BYTES = DEVICE_DATA_MAX_MIB * 2**20


def _is_default(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` is TF's default (no-op) strategy."""
  with tf.init_scope():
    if tf.distribute.has_strategy():
      return False
    return strategy is tf.distribute.get_strategy()


def supports(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` can train from device-resident data (one host).

  `MultiWorkerMirroredStrategy`, `ParameterServerStrategy` and
  `CentralStorageStrategy` are not `MirroredStrategy` subclasses, so they
  keep `tf.data` (each worker reads its own pipeline).
  """
  one_host = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy)
  return isinstance(strategy, one_host) or _is_default(strategy)


def check_input_mode(input_mode: str, strategy: tf.distribute.Strategy) -> None:
  """Raises a clear `ValueError` for an unknown or impossible `input_mode`."""
  if input_mode not in INPUT_MODE_CHOICES:
    raise ValueError(f"input_mode={input_mode!r} is unknown. Choose one of "
                     f"{', '.join(INPUT_MODE_CHOICES)}.")
  if input_mode == "device" and not supports(strategy):
    raise ValueError(
        f"input_mode='device' needs a one-host strategy (mirrored, "
        f"one_device, default); got {type(strategy).__name__}, which reads "
        "through tf.data (multi-worker and parameter-server workers have "
        "their own pipelines). Use input_mode='auto' or 'tf_data'.")


def nbytes(data) -> int:
  """The bytes of every array in a nested structure."""
  return sum(int(np.asarray(a).nbytes) for a in tf.nest.flatten(data))


def use_device_data(input_mode: str, strategy: tf.distribute.Strategy,
                    data, max_bytes: int = DEFAULT_MAX_BYTES) -> bool:
  """Resolves `input_mode` for these arrays.

  Args:
    input_mode: one of `INPUT_MODE_CHOICES`.
    strategy: the strategy training will run under.
    data: the training arrays, `(x, y)` or `(x, y, sample_weight)` (any
      nesting).
    max_bytes: `auto` holds the data on the devices only if all replicas'
      copies together take at most this many bytes.

  Returns:
    `True` to train from `DeviceData`, `False` for `tf.data`.
  """
  if input_mode != "auto":
    return input_mode == "device"
  if not supports(strategy):
    return False
  total = nbytes(data) * strategy.num_replicas_in_sync
  if total > max_bytes:
    logging.info("input_mode='auto': %d replica copies of the data would take "
                 "%.0f MiB (> %.0f MiB); reading through tf.data instead.",
                 strategy.num_replicas_in_sync, total / 2**20,
                 max_bytes / 2**20)
    return False
  return True


@dataclasses.dataclass(frozen=True)
class EpochBatches:
  """One epoch's arguments for a resident train function (a `tf.function`
  argument: distributed values and tensors only).

  Attributes:
    data: the training set (`(x, y[, sample_weight])`, any nesting) on every
      replica's device.
    index: per replica, `[steps, per_replica_batch]` rows to gather.
  """
  data: object
  index: object

  def from_step(self, step: int) -> tuple:
    """The argument of a call whose first step is `step` of the epoch."""
    return (self.data, self.index, tf.constant(step, tf.int32))


class DeviceData:
  """The training arrays, copied once to each replica's device.

  Args:
    strategy: a strategy for which `supports` holds.
    data: `(x, y[, sample_weight])`, arrays in any nesting, all with the
      same number of rows.
  """

  def __init__(self, strategy: tf.distribute.Strategy, data):
    self.strategy = strategy
    self.num_examples = len(tf.nest.flatten(data)[0])
    self.data = tf.nest.map_structure(
        lambda a: on_each_device(strategy, lambda _: a), data)

  def epoch(self, *, global_batch_size: int, steps: int, seed: int,
            epoch: int, shuffle: bool) -> EpochBatches:
    """The index table of one epoch: the order of `inputs.array_dataset_fn`.

    Global step `k` takes rows `order[k*G:(k+1)*G]` (`G` the global batch)
    and replica `r` the `r`-th consecutive slice of them, as the `tf.data`
    path's consecutive per-replica batches do.
    """
    replicas = self.strategy.num_replicas_in_sync
    inputs.check_global_batch(global_batch_size, replicas)
    if steps * global_batch_size > self.num_examples:
      raise ValueError(f"steps={steps} of global_batch_size="
                       f"{global_batch_size} need more than the "
                       f"{self.num_examples} examples held; use at most "
                       f"{self.num_examples // global_batch_size} steps or a "
                       "smaller batch.")
    order = inputs.epoch_indices(self.num_examples, seed=seed, epoch=epoch,
                                   shuffle=shuffle)
    table = order[:steps * global_batch_size].astype(np.int32).reshape(
        steps, replicas, global_batch_size // replicas)
    index = on_each_device(self.strategy, lambda r: table[:, r, :])
    return EpochBatches(self.data, index)


def on_each_device(strategy: tf.distribute.Strategy,
                   value_fn: Callable[[int], Any]) -> Any:
  """`value_fn(replica_id)` (arrays in any nesting) copied once to each
  replica's device, as a distributed value (a strategy for which
  `supports` holds)."""
  try:
    devices = strategy.extended.worker_devices
  except RuntimeError:  # The default strategy: one replica, no device set.
    devices = (None,)

  def place(ctx: tf.distribute.experimental.ValueContext):
    with tf.device(devices[ctx.replica_id_in_sync_group]):
      return tf.nest.map_structure(
          tf.identity, value_fn(ctx.replica_id_in_sync_group))

  return strategy.experimental_distribute_values_from_function(place)


def gather_batch(data, index: tf.Tensor, step: tf.Tensor) -> tuple:
  """One replica's batch of step `step` (call in replica context)."""
  rows = index[step]
  return tuple(tf.nest.map_structure(lambda a: tf.gather(a, rows), data))
