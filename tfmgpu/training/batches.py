"""Batches of in-memory arrays, and the arithmetic of a global batch.

A global batch is split evenly over the replicas (`check_global_batch`).
Each epoch reads the arrays in an order fixed by the seed and the epoch
(`epoch_order`), so that a resumed run reads what an uninterrupted one
would; the last, short batch is padded (`pad_rows`) with a mask of zeros
where a step needs whole batches. `array_dataset_fn` and
`distribute_arrays` make the `tf.data` pipelines over arrays (pipeline `i`
takes every n-th row), `with_mask` adds the mask of ones to a user's
batches, and `dataset_fn_from_step` starts a dataset function at a step.
`tfmgpu.training.inputs` says what the user's inputs are, and re-exports
these names.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from tfmgpu import checks


def check_global_batch(global_batch_size: int, num_replicas: int,
                       what: str = "the strategy") -> int:
  """Returns the per-replica batch size, or raises a clear error.

  Raises:
    ValueError: not a positive multiple of `num_replicas`.
  """
  if global_batch_size < 1:
    raise ValueError(f"global_batch_size={global_batch_size} must be >= 1.")
  checks.check_divisible("global_batch_size", global_batch_size,
                         num_replicas, f"the {num_replicas} replicas of {what}")
  return global_batch_size // num_replicas


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example order of one epoch: a permutation fixed by (seed, epoch).

  Deriving it from the epoch number (not from an iterator's state) makes a
  resumed run see exactly the data an uninterrupted run would.
  """
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def epoch_indices(num_examples: int, *, seed: int, epoch: int,
                  shuffle: bool) -> np.ndarray:
  """`epoch_order(num_examples, seed, epoch)` if `shuffle`, else input order."""
  if shuffle:
    return epoch_order(num_examples, seed, epoch)
  return np.arange(num_examples)


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
  """`a` with zero rows appended up to `rows` rows (`a` itself if it has
  them)."""
  if len(a) == rows:
    return a
  return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])


def with_mask(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`(x, y[, sw])` batches as `(x, y, mask[, sw])` with a mask of ones."""
  def add(*batch):
    rows = tf.shape(tf.nest.flatten(batch[0])[0])[0]
    return (batch[0], batch[1], tf.ones([rows], tf.float32)) + tuple(batch[2:])
  return dataset.map(add)


def array_dataset_fn(data: tuple, *, global_batch_size: int,
                     order: np.ndarray | None, drop_remainder: bool,
                     repeat: bool = False):
  """`fn(input_context)` over in-memory arrays (the order of `epoch_order`:
  pipeline `i` takes every n-th row, batched per replica)."""
  if order is not None:
    data = tf.nest.map_structure(lambda a: a[order], data)

  def dataset_fn(ctx=None):
    per_replica = global_batch_size
    part = data
    if ctx is not None:
      per_replica = ctx.get_per_replica_batch_size(global_batch_size)
      if ctx.num_input_pipelines > 1:
        part = tf.nest.map_structure(
            lambda a: a[ctx.input_pipeline_id::ctx.num_input_pipelines], data)
    ds = tf.data.Dataset.from_tensor_slices(part)
    if repeat:
      ds = ds.repeat()
    ds = ds.batch(per_replica, drop_remainder=drop_remainder)
    return ds.prefetch(tf.data.AUTOTUNE)

  return dataset_fn


def distribute_arrays(strategy: tf.distribute.Strategy, data: tuple, *,
                      global_batch_size: int, order: np.ndarray | None = None,
                      drop_remainder: bool = True):
  """`array_dataset_fn(...)` distributed over `strategy`'s replicas."""
  check_global_batch(global_batch_size, strategy.num_replicas_in_sync)
  return strategy.distribute_datasets_from_function(array_dataset_fn(
      data, global_batch_size=global_batch_size, order=order,
      drop_remainder=drop_remainder))


def dataset_fn_from_step(fn: Callable[..., tf.data.Dataset], step: int):
  """`fn` started at global step `step`: `fn.from_step(step)` when `fn` can
  seek, else `fn(ctx)` with the batches of `step` steps skipped (a step takes
  one batch per replica that the pipeline feeds)."""
  if not step:
    return fn
  if hasattr(fn, "from_step"):
    return fn.from_step(step)

  def skipped(ctx):
    per_pipeline = max(ctx.num_replicas_in_sync // ctx.num_input_pipelines, 1)
    return fn(ctx).skip(step * per_pipeline)

  return skipped
