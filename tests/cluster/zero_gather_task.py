"""One worker of test_zero_multi_worker: all_gather_owned, and the missing
ring reduce-scatter, under a 2-worker MultiWorkerMirroredStrategy."""

import tensorflow as tf

from tfmgpu.parallel import zero_collectives

strategy = tf.distribute.MultiWorkerMirroredStrategy()
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


@tf.function
def reduce_scatter():
  return tf.raw_ops.CollectiveReduceScatterV2(
      input=tf.ones([4]), group_size=2, group_key=9001, instance_key=9002,
      ordering_token=[], merge_op="Add", final_op="Id")


try:
  print("reduce_scatter", reduce_scatter().numpy().tolist(), flush=True)
except tf.errors.OpError as e:
  print("reduce_scatter unavailable", type(e).__name__, flush=True)
