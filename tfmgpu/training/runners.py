"""Step runners: "run up to n steps and return their sums".

A runner is what the `Controller` (`tfmgpu.training.controller`) drives.
`SyncRunner` calls a compiled `strategy.run` function
(`tfmgpu.training.distributed`) once per call, feeding it batches as
`tfmgpu.training.feeds` says: from a distributed `tf.data` iterator, from
device-resident arrays (`tfmgpu.training.resident`), or from one host
iterator whose global batches the function splits. An execution
(`tfmgpu.training.execution`) makes it; the parameter-server runner,
`CoordinatorRunner`, lives in `tfmgpu.training.coordinator`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training import resident
from tfmgpu.training.controller import StepSums


def to_sums(out: dict[str, Any], steps: int) -> StepSums:
  """A train function's result (tensors) as host values."""
  return StepSums(steps=steps, loss=float(out["loss"]),
                  count=float(out["count"]),
                  loss_rows=float(out["loss_rows"]),
                  non_finite=float(out["non_finite"]),
                  metrics={k: np.asarray(v) for k, v in out.items()
                           if k.startswith("metric/")})


class SyncRunner:
  """Synchronous steps under `strategy.run`, `steps_per_execution` per call.

  In-memory arrays: each replica sees exactly the examples of
  `tfmgpu.training.inputs.array_dataset_fn`'s order (seeded by `seed` and the epoch), from
  `tf.data` or from device-resident copies, so a resumed run skips exactly
  the steps already done. A user's dataset of global batches gives each
  replica the same rows whether TF splits it or the step does
  (`feeds.HOST_SPLIT`). A user's dataset (or dataset function) is iterated
  afresh each epoch, skipping the steps a resumed epoch already did; an
  infinite one is iterated once, across epochs.

  Args:
    train_fn: from `distributed.make_train_function` (its `feed` must
      match `feed` here).
    strategy: the strategy `train_fn` runs under.
    source: the input (`inputs.from_user`).
    global_batch_size: examples per step over all replicas (arrays).
    steps_per_execution: steps per call.
    seed, shuffle: the epoch order (arrays).
    feed: how batches reach the replicas (`tfmgpu.training.feeds`):
      `DEVICE` (arrays only), `HOST_SPLIT` (a `tf.data.Dataset` only) or
      `ITERATOR`.
  """

  coordinator_only = False

  def __init__(self, train_fn: Callable[..., dict[str, tf.Tensor]],
               strategy: tf.distribute.Strategy, source: inputs.InputData,
               *, global_batch_size: int | None, steps_per_execution: int,
               seed: int, shuffle: bool, steps_per_epoch: int,
               feed: str):
    self.train_fn = train_fn
    self.strategy = strategy
    self.source = source
    self.global_batch_size = global_batch_size
    self.steps_per_execution = steps_per_execution
    self.seed, self.shuffle = seed, shuffle
    self.steps_per_epoch = steps_per_epoch
    self.feed = feed
    self._held: resident.DeviceData | None = None
    self._batches: Any = None
    self._endless: Any = None
    self._endless_known: bool | None = None

  def start_epoch(self, epoch: int, first_step: int) -> None:
    if isinstance(self.source, inputs.ArrayData):
      self._batches = (self._held_epoch(epoch) if self.feed == feeds.DEVICE
                       else iter(self._array_epoch(epoch, first_step)))
    else:
      self._batches = self._user_epoch(epoch, first_step)

  def run(self, done: int, limit: int) -> StepSums:
    n = min(self.steps_per_execution, limit)
    batches = (self._batches.from_step(done) if self.feed == feeds.DEVICE
               else self._batches)
    return to_sums(self.train_fn(batches, tf.constant(n)), n)

  def _held_epoch(self, epoch: int) -> resident.EpochBatches:
    if self._held is None:  # Copied once, when there is an epoch to train.
      self._held = resident.DeviceData(self.strategy, self.source.data)
    return self._held.epoch(
        global_batch_size=self.global_batch_size, steps=self.steps_per_epoch,
        seed=self.seed, epoch=epoch, shuffle=self.shuffle)

  def _array_epoch(self, epoch: int, first_step: int):
    """The epoch's distributed dataset, from step `first_step` on (resume)."""
    # With `array_dataset_fn`'s interleaved sharding each global batch is a
    # contiguous slice of the epoch's order: the rest of it is the rest.
    order = inputs.epoch_indices(self.source.num_examples, seed=self.seed,
                                   epoch=epoch, shuffle=self.shuffle)
    return inputs.distribute_arrays(
        self.strategy, self.source.data,
        global_batch_size=self.global_batch_size,
        order=order[first_step * self.global_batch_size:])

  def _user_epoch(self, epoch: int, first_step: int):
    """An iterator over the user's dataset from step `first_step` of the
    epoch. An endless one is created once and runs on across epochs; a
    resumed run starts it at the global step reached (`epoch *
    steps_per_epoch + first_step`): a dataset function with a
    `from_step(step)` method seeks there, others skip the batches. A finite
    dataset longer than an epoch also runs on, as Keras' iterator does
    (each epoch takes the next batches), starting a new pass when one ends
    instead of running out; so does one of unknown length (TF's
    `from_generator`, `filter`), whose passes are not counted."""
    if self._endless is not None:
      return self._endless
    endless = self._is_endless()
    start = epoch * self.steps_per_epoch + first_step if endless else first_step
    passes = self._pass_length()
    if passes is not None:
      start %= passes
    repeat = passes is not None or self._unknown_length()
    if isinstance(self.source, inputs.DatasetData):  # Global batches.
      dataset = self.source.dataset
      dataset = dataset.repeat() if repeat else dataset
      dataset = dataset.skip(start) if start else dataset
      batches = (dataset if self.feed == feeds.HOST_SPLIT
                 else self.strategy.experimental_distribute_dataset(dataset))
    else:
      fn = self.source.fn
      if repeat:
        fn = functools.partial(_repeated, fn)
      batches = self.strategy.distribute_datasets_from_function(
          inputs.dataset_fn_from_step(fn, start))
    iterator = iter(batches)
    if endless:
      self._endless = iterator
    return iterator

  def _cardinality(self) -> int | None:
    if isinstance(self.source, inputs.DatasetData):
      return self.source.cardinality
    return self.source.cardinality(self.strategy)

  def _pass_length(self) -> int | None:
    """Steps in one pass of a finite dataset that runs on across epochs
    (longer than an epoch, not seekable), else `None`."""
    card = self._cardinality()
    seekable = hasattr(getattr(self.source, "fn", None), "from_step")
    if card in (None, inputs.INFINITE) or seekable:
      return None
    return card if card > self.steps_per_epoch else None

  def _unknown_length(self) -> bool:
    """A dataset whose length TF does not know (not a seekable stream)."""
    seekable = hasattr(getattr(self.source, "fn", None), "from_step")
    return self._cardinality() is None and not seekable

  def _is_endless(self) -> bool:
    if self._endless_known is None:
      # A dataset TF knows to be infinite, a stream that can seek
      # (`from_step`, e.g. `tfmgpu.datasets.tfrecord`), a finite dataset
      # longer than an epoch and one of unknown length run on across epochs,
      # as Keras' iterator does; one of exactly one epoch is read afresh
      # each epoch.
      seekable = hasattr(getattr(self.source, "fn", None), "from_step")
      self._endless_known = (self._cardinality() == inputs.INFINITE
                             or seekable or self._pass_length() is not None
                             or self._unknown_length())
    return self._endless_known


def _repeated(fn: Callable[..., tf.data.Dataset], context) -> tf.data.Dataset:
  """`fn(context)`, repeated: a finite per-worker dataset that runs on."""
  return fn(context).repeat()
