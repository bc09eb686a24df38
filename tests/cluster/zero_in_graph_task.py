"""The client of test_zero_in_graph: ZeRO over two worker processes' CPUs.

argv: the two workers' addresses and a directory; task 1 is a bare `tf.distribute.Server`,
task 0 (this process) connects to the cluster and trains a `ShardedModel`
whose devices are one CPU of each task (in-graph: this client drives both).
Prints each stage's largest difference from the unsplit run, where each
weight and slot lives, and the digest of the unsplit model restored from
the stage-3 checkpoint.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfmgpu
from tfmgpu.parallel import zero

CLUSTER = tf.train.ClusterSpec({"worker": sys.argv[1:3]})
tf.config.experimental_connect_to_cluster(CLUSTER, job_name="worker",
                                          task_index=0)
DEVICES = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in (0, 1)]
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4)).astype("float32")
Y = RNG.normal(size=(16, 2)).astype("float32")
FIT = dict(epochs=2, global_batch_size=8)


def build():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                           keras.layers.Dense(2)])


def train(model, optimizer):
  trainer = tfmgpu.Trainer(model, optimizer=optimizer, loss="mse",
                           learning_rate=1e-2, verbose=0)
  trainer.fit(X, Y, **FIT)
  return trainer


def where(variables):
  return sorted({v.value.device if isinstance(v, keras.Variable)
                 else v.device for v in variables})


for optimizer in ("sgd", "adam"):
  reference = build()
  train(reference, optimizer)
  for stage in (1, 3):
    unsplit = build()
    sharded = zero.ShardedModel(unsplit, DEVICES, stage=stage)
    trainer = train(sharded, optimizer)
    diff = max(float(np.abs(a - b).max()) for a, b in
               zip(unsplit.get_weights(), reference.get_weights()))
    print(f"{optimizer} stage {stage} maxdiff {diff:.3g}", flush=True)
    owners = {v.path: sharded.owners[v.path] for v in unsplit.weights}
    print(f"{optimizer} stage {stage} on owner "
          f"{all(where([v]) == [owners[v.path]] for v in unsplit.weights)}"
          f" tasks {where(unsplit.weights)}", flush=True)
    if stage == 3 and optimizer == "adam":
      print("slot tasks", where(trainer.optimizer.variables[2:]), flush=True)
      path = tf.train.Checkpoint(model=sharded).save(sys.argv[3] + "/ckpt")
      plain = build()  # Restores into the unsplit model, on this host.
      tf.train.Checkpoint(model=plain).read(path).expect_partial()
      same = all(np.array_equal(a, b) for a, b in
                 zip(plain.get_weights(), unsplit.get_weights()))
      print("restored unsplit equal", same, flush=True)
