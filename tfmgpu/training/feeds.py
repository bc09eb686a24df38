"""How each step's batch reaches the replicas: the loop's three feeds.

- `ITERATOR`: a distributed `tf.data` iterator. TF splits each global batch
  (`strategy.experimental_distribute_dataset`) or reads each worker's
  pipeline (`distribute_datasets_from_function`) and prefetches each
  replica's part to its device. Any strategy, any cluster.
- `DEVICE`: in-memory arrays held on every replica's device; each replica
  gathers its rows there (`tfmgpu.training.resident`).
- `HOST_SPLIT`: a user's `tf.data.Dataset` of global batches read by one
  plain iterator on the host; inside the step function each replica takes
  its contiguous slice of the batch, the same rows TF's split gives it.
  The step also learns the batch's rows, so a short last batch split
  unevenly is averaged over its rows, as on one device (TF's iterator
  averages each replica's share as if every replica had as many rows).
  Chosen on one host when every replica's device is a CPU: their memory is
  the host's, so prefetching to them copies nothing useful, and one
  pipeline costs less host time than one per replica (measured: 14-37%
  faster steps on CPUs split into logical devices, `docs/benchmarks.md`).
  GPUs keep `ITERATOR`, whose prefetch overlaps the copy to the device.

`host_split_refusal` says why a dataset cannot be split on the host (the
Trainer logs the feed it picks); `split_batch` does the split.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmgpu import strategies as strategies_lib
from tfmgpu.training import resident

ITERATOR = "iterator"
DEVICE = "device"
HOST_SPLIT = "host_split"


def replica_device_types(strategy: tf.distribute.Strategy) -> set[str]:
  """The device types (`"CPU"`, `"GPU"`, ...) the replicas run on
  (`tfmgpu.strategies.replica_devices`: the default strategy's one replica
  counts as the first accelerator)."""
  return {tf.DeviceSpec.from_string(d).device_type or "CPU"
          for d in strategies_lib.replica_devices(strategy)}


def host_split_refusal(strategy: tf.distribute.Strategy,
                       element_spec: Any) -> str | None:
  """Why a dataset with `element_spec` cannot feed `strategy` by
  `HOST_SPLIT` (`None`: it can).

  It can on a one-host strategy (`resident.supports`) whose replicas are
  CPUs, when every leaf of an element is a dense tensor with a batch
  dimension.
  """
  if not resident.supports(strategy):
    return ("not a one-host strategy: each worker reads a pipeline of its "
            "own")
  kinds = replica_device_types(strategy) - {"CPU"}
  if kinds:
    return (f"the replicas run on {', '.join(sorted(kinds))}: TF's iterator "
            "prefetches each part to its device")
  for spec in tf.nest.flatten(element_spec):
    if type(spec) is not tf.TensorSpec:  # pylint: disable=unidiomatic-typecheck
      return f"an element holds a {type(spec).__name__}"
    if spec.shape.rank is None or spec.shape.rank < 1:
      return f"an element holds a tensor without a batch dimension ({spec})"
  return None


def rows_of(batch: Any) -> tf.Tensor:
  """The rows of a batch (its first leaf's first dimension)."""
  return tf.shape(tf.nest.flatten(batch)[0])[0]


def _slice_of(batch: Any, replica: int, replicas: int) -> Any:
  """Rows `[replica * k, (replica + 1) * k)` of every leaf, `k` the batch
  divided by `replicas` rounded up (TF's split; a short last batch leaves
  the last replicas fewer rows, or none)."""
  rows = rows_of(batch)
  per = (rows + replicas - 1) // replicas
  start = tf.minimum(replica * per, rows)
  stop = tf.minimum(start + per, rows)
  return tf.nest.map_structure(lambda t: t[start:stop], batch)


def split_batch(strategy: tf.distribute.Strategy, batch: Any) -> Any:
  """`batch` (one global batch, any nesting) as per-replica values: replica
  `i` gets the `i`-th contiguous slice. Call in cross-replica context."""
  replicas = strategy.num_replicas_in_sync
  if replicas == 1:
    return batch
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: _slice_of(batch, ctx.replica_id_in_sync_group, replicas))
