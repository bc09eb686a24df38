"""ZeRO's all-gather across workers: each replica's owned values to all.

The first piece of multi-worker ZeRO (issue 28), not yet wired into a
strategy: `--strategy=multi_worker_mirrored --zero_stage=N` is still
refused. What TF 2.21 offers across workers, probed on CPU with two
`MultiWorkerMirroredStrategy` workers (one replica each):

- `ReplicaContext.all_gather` and `.all_reduce` work (RING collectives);
- `tf.raw_ops.CollectiveReduceScatterV2` builds but fails at run time
  ("CollectiveRegistry::Lookup did not find collective implementation"):
  TF has no ring reduce-scatter; only NCCL (GPUs) implements it. On CPU
  workers the gradients of a multi-worker ZeRO step must therefore be
  all-reduced and then kept only on their owners (the bytes sent are an
  all-reduce's, not a reduce-scatter's half).

`all_gather_owned` is the other half of the step: after each owner has
updated its own weights, one `all_gather` of a flat vector per replica
(its owned values, padded to the longest replica's) gives every replica
every new value.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def _replica_id(ctx: tf.distribute.ReplicaContext) -> int:
  rid = tf.get_static_value(ctx.replica_id_in_sync_group)
  if rid is None:
    raise ValueError("all_gather_owned needs a static replica id (a "
                     "MultiWorkerMirroredStrategy or MirroredStrategy "
                     "replica); got a dynamic one.")
  return int(rid)


def all_gather_owned(values: Sequence[tf.Tensor],
                     owners: Sequence[int]) -> list[tf.Tensor]:
  """Every replica gets each value from its owner (call in replica context).

  Args:
    values: one tensor per variable, the same shapes and dtypes on every
      replica; only the owner's value of each is used.
    owners: the replica (`replica_id_in_sync_group`) that owns each value,
      e.g. from `zero_shards.assign_owners`.

  Returns:
    The owners' values, in the order of `values`, on this replica. Float
    values travel as float32 (exact for float16, bfloat16 and float32).

  Raises:
    ValueError: `owners` and `values` differ in length, or an owner is not
      a replica.
  """
  ctx = tf.distribute.get_replica_context()
  replicas = ctx.num_replicas_in_sync
  if len(owners) != len(values):
    raise ValueError(f"owners has {len(owners)} entries; values has "
                     f"{len(values)}: give one owner per value.")
  if any(not 0 <= o < replicas for o in owners):
    raise ValueError(f"owners={list(owners)} must be replica indices in "
                     f"[0, {replicas}).")
  sizes = [int(tf.TensorShape(v.shape).num_elements()) for v in values]
  mine = _replica_id(ctx)
  totals = [sum(s for s, o in zip(sizes, owners) if o == r)
            for r in range(replicas)]
  width = max(max(totals), 1)
  flat = [tf.reshape(tf.cast(v, tf.float32), [-1])
          for v, o in zip(values, owners) if o == mine]
  row = tf.concat(flat + [tf.zeros([width - totals[mine]])], axis=0)
  table = ctx.all_gather(row[None], axis=0)  # [replicas, width]
  offsets = [0] * replicas
  out = []
  for v, s, o in zip(values, sizes, owners):
    part = table[o, offsets[o]:offsets[o] + s]
    offsets[o] += s
    out.append(tf.cast(tf.reshape(part, tf.shape(v)), v.dtype))
  return out
