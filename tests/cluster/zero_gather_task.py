"""One worker of test_zero_multi_worker: all_gather_owned, the missing ring
reduce-scatter, and a ZeRO stage-1 Adam step against the unsharded one,
under a 2-worker MultiWorkerMirroredStrategy (one replica per worker)."""

import hashlib

import keras
import numpy as np
import tensorflow as tf

from tfmgpu.parallel import zero_collectives
from tfmgpu.parallel import zero_shards
from tfmgpu.training import allreduce

strategy = tf.distribute.MultiWorkerMirroredStrategy()
ME = strategy.cluster_resolver.task_id
SHAPES = [(3, 2), (5,), (1,), (2, 2)]
OWNERS = [1, 0, 1, 0]


@tf.function
def gather():
  ctx = tf.distribute.get_replica_context()
  me = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
  # Only the owner's value is right; the others send garbage (-1 - me).
  values = [tf.fill(s, tf.where(tf.equal(me, o), 10.0 * o + j, -1.0 - me))
            for j, (s, o) in enumerate(zip(SHAPES, OWNERS))]
  return zero_collectives.all_gather_owned(values, OWNERS)


got = strategy.experimental_local_results(strategy.run(gather))[0]
print("gathered", [sorted(set(g.numpy().ravel().tolist())) for g in got],
      flush=True)


def train(zero: bool) -> str:
  """3 Adam steps of a small MLP; the digest of its weights, unsharded
  slots and step count."""
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(2)])
  variables = model.trainable_variables
  owners = zero_shards.assign_owners(
      [zero_shards.variable_bytes(v) for v in variables], 2)
  if zero:  # Made and built outside the scope: its slots are local.
    optimizer = keras.optimizers.Adam(1e-2)
    zero_collectives.build_owned_optimizer(optimizer, variables, owners, ME)
  else:
    with strategy.scope():
      optimizer = keras.optimizers.Adam(1e-2)
      optimizer.build(variables)
    allreduce.take_over_aggregation(optimizer)
  slots = [tuple(v.shape) for v in optimizer.variables[2:]]
  rng = np.random.default_rng(ME)
  x = tf.constant(rng.normal(size=(8, 4)), tf.float32)
  y = tf.constant(rng.normal(size=(8, 2)), tf.float32)

  @tf.function
  def step():
    def replica_step():
      ctx = tf.distribute.get_replica_context()
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum((model(x) - y) ** 2) / 16
      grads = ctx.all_reduce("sum", tape.gradient(loss, variables))
      if zero:
        zero_collectives.apply_owned(optimizer, grads, variables, owners)
      else:
        optimizer.apply_gradients(zip(grads, variables))
    strategy.run(replica_step)

  for _ in range(3):
    step()
  mine = [tuple(v.shape) for v, o in zip(variables, owners) if o == ME]
  print("zero" if zero else "plain", "slots", slots, "owned", mine,
        flush=True)
  full = optimizer
  if zero:  # The unsharded slots, as a portable save would write them.
    full = keras.optimizers.Adam(1e-2)
    full.build(variables)
    strategy.run(tf.function(lambda: zero_collectives.gather_slots(
        optimizer, full, variables, owners)))
    back = zero_collectives.build_owned_optimizer(
        keras.optimizers.Adam(1e-2), variables, owners, ME)
    zero_collectives.scatter_slots(full, back, variables, owners, ME)
    print("scattered equal", all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(optimizer.variables, back.variables)), flush=True)
  state = [v.numpy() for v in variables] + [
      s.numpy() for row in zero_collectives.slots_by_variable(
          full, len(variables)) for s in row] + [full.iterations.numpy()]
  return hashlib.sha256(b"".join(a.tobytes() for a in state)).hexdigest()


print("digests", train(False), train(True), flush=True)


@tf.function
def reduce_scatter():
  return tf.raw_ops.CollectiveReduceScatterV2(
      input=tf.ones([4]), group_size=2, group_key=9001, instance_key=9002,
      ordering_token=[], merge_op="Add", final_op="Id")


try:
  print("reduce_scatter", reduce_scatter().numpy().tolist(), flush=True)
except tf.errors.OpError as e:
  print("reduce_scatter unavailable", type(e).__name__, flush=True)
