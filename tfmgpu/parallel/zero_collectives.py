"""ZeRO's all-gather across workers: each replica's owned values to all.

Between-graph ZeRO (every worker running its own program, as under
`MultiWorkerMirroredStrategy`), for code that trains so itself.
`--strategy=multi_worker_mirrored --zero_stage=N` does not use it: it runs
in-graph (`tfmgpu.in_graph`), where each weight and slot, stage 3's
weights too, lives in its owner's process only, which mirrored variables
cannot do. What TF 2.21 offers across workers, probed on CPU with two
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
every new value. `build_owned_optimizer` and `apply_owned` make stage 1 of
such a step (tested against the unsharded step on 2 workers, Adam, equal
bit for bit): the optimizer is built *outside* the strategy's scope on the
worker's own variables only, so its slots are plain local variables that
exist on their owner alone (built in the scope, the workers' different
slot sets break MWMS's variable-initialising broadcasts: "Shape mismatch
in the collective instance"); each owner applies its summed gradients,
and the owners' new values are all-gathered into every worker's copy.
`gather_slots` copies every owner's slots into an unsharded optimizer on
every worker (for a portable save: the chief writes one checkpoint, with
the slots in the unsharded layout); `scatter_slots` takes them back after
a restore.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu.parallel import zero_shards
from tfmgpu.training import allreduce as allreduce_lib


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


def owned(variables: Sequence[Any], owners: Sequence[int],
          replica: int) -> list[Any]:
  """The variables `replica` owns, in order."""
  return [v for v, o in zip(variables, owners) if o == replica]


def build_owned_optimizer(optimizer: keras.optimizers.Optimizer,
                          variables: Sequence[Any], owners: Sequence[int],
                          replica: int) -> keras.optimizers.Optimizer:
  """Builds `optimizer` on `replica`'s own variables, its slots local.

  Call outside any strategy scope, on the worker that holds `replica`
  (under `MultiWorkerMirroredStrategy` with one replica per worker, its
  `cluster_resolver.task_id`). The optimizer's own gradient all-reduce is
  turned off: `apply_owned` gets gradients already summed.

  Returns:
    `optimizer`, built: slots for the owned variables only.
  """
  if tf.distribute.has_strategy():
    raise ValueError("build_owned_optimizer: call it outside "
                     "`strategy.scope()`; in the scope each worker's slots "
                     "would be mirrored variables, which every worker must "
                     "create alike.")
  optimizer.build(owned(variables, owners, replica))
  allreduce_lib.take_over_aggregation(optimizer)
  return optimizer


def apply_owned(optimizer: keras.optimizers.Optimizer,
                grads: Sequence[tf.Tensor], variables: Sequence[Any],
                owners: Sequence[int]) -> None:
  """ZeRO stage 1's update, in replica context: each replica applies the
  summed gradients of the variables it owns (its own slots), then every
  replica's variables take the owners' new values (`all_gather_owned`).

  Args:
    optimizer: from `build_owned_optimizer`.
    grads: one summed gradient per variable (e.g. `ctx.all_reduce`).
    variables: the model's trainable variables (mirrored over workers).
    owners: the owning replica of each variable.
  """
  ctx = tf.distribute.get_replica_context()
  mine = _replica_id(ctx)
  optimizer.apply_gradients(zip(owned(grads, owners, mine),
                                owned(variables, owners, mine)))
  storage = [v.value if isinstance(v, keras.Variable) else v
             for v in variables]
  new = all_gather_owned([tf.convert_to_tensor(s) for s in storage], owners)

  def assign_all(strategy, values):
    for s, value in zip(storage, values):
      strategy.extended.update(s, lambda var, val: var.assign(val),
                               args=(value,))

  ctx.merge_call(assign_all, args=(new,))


def slots_by_variable(optimizer: keras.optimizers.Optimizer,
                      count: int) -> list[list[Any]]:
  """`optimizer`'s slots (its step counter and learning rate left out),
  one list per variable it was built for: Keras 3 creates them variable
  by variable (Adam: momentum, velocity)."""
  slots = zero_shards.optimizer_slots(optimizer)
  if count == 0 or len(slots) % count:
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    raise ValueError(f"optimizer {inner.name!r} has {len(slots)} slots for "
                     f"{count} variables; expected a whole number of slots "
                     "per variable.")
  k = len(slots) // count
  return [slots[i * k:(i + 1) * k] for i in range(count)]


def gather_slots(optimizer: keras.optimizers.Optimizer,
                 full: keras.optimizers.Optimizer,
                 variables: Sequence[Any], owners: Sequence[int]) -> None:
  """Every worker's `full` optimizer takes each owner's slots (in replica
  context; one all-gather): the unsharded slots, e.g. for a checkpoint
  that restores into `mirrored` or an unsplit model.

  Args:
    optimizer: from `build_owned_optimizer` (this replica's slots).
    full: the same kind of optimizer built (outside the strategy's scope)
      on all of `variables`.
    variables: the model's trainable variables.
    owners: the owning replica of each variable.
  """
  mine = _replica_id(tf.distribute.get_replica_context())
  own = iter(slots_by_variable(optimizer,
                               len(owned(variables, owners, mine))))
  whole = slots_by_variable(full, len(variables))
  values, slot_owners = [], []
  for o, targets in zip(owners, whole):
    sources = next(own) if o == mine else [None] * len(targets)
    for target, source in zip(targets, sources):
      values.append(tf.zeros(target.shape, target.dtype) if source is None
                    else tf.convert_to_tensor(source))
      slot_owners.append(o)
  new = all_gather_owned(values, slot_owners)
  for target, value in zip((t for ts in whole for t in ts), new):
    target.assign(value)
  full.iterations.assign(optimizer.iterations)


def scatter_slots(full: keras.optimizers.Optimizer,
                  optimizer: keras.optimizers.Optimizer,
                  variables: Sequence[Any], owners: Sequence[int],
                  replica: int) -> None:
  """The reverse of `gather_slots`, after a restore: `optimizer` (built by
  `build_owned_optimizer` for `replica`) takes its own variables' slots
  from `full` (the unsharded optimizer every worker restored). Local: no
  collective."""
  whole = slots_by_variable(full, len(variables))
  own = slots_by_variable(optimizer, len(owned(variables, owners, replica)))
  for targets, sources in zip(own, owned(whole, owners, replica)):
    for target, source in zip(targets, sources):
      target.assign(source)
  optimizer.iterations.assign(full.iterations)
