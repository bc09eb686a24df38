"""A parameter-server run against one device (run by
test_parameter_server.py, under `tfmgpu.launch --num_workers=1
--num_ps=N --coordinator`).

argv: the model directory and `variable_shards` (0: variables whole). The
chief trains a tiny model on one worker (its steps run one after another,
as on one device; whole passes over the rows, which its stream does not
restart each epoch), then the same model on one device in this process;
it prints the largest weight difference, what the checkpoint holds, and
how far `tfmgpu.predict` on the coordinator is from the one-device model's.
The model's 1-unit layer gives it variables whose first dimension is 1
(the next kernel, (1, 3), and its own bias), which stay whole however many
shards the others are split into: one run has both kinds.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfmgpu
from tfmgpu import cluster

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 6)).astype(np.float32)
Y = RNG.integers(0, 3, 256)


def trained(strategy, **kwargs):
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1),
                              keras.layers.Dense(3)])
  trainer_class = (tfmgpu.ParameterServerTrainer if kwargs
                   else tfmgpu.Trainer)
  trainer = trainer_class(model, strategy=strategy, verbose=0,
                          optimizer="adam", learning_rate=0.05, **kwargs)
  trainer.fit(X, Y, epochs=2, steps_per_epoch=8, global_batch_size=32,
              shuffle=False)
  return model


def main(model_dir, shards):
  strategy = tfmgpu.get_strategy("parameter_server",
                                 variable_shards=shards or None)
  model = trained(strategy, model_dir=model_dir)
  print("parts", [len(getattr(v.value, "variables", [v]))
                  for v in model.weights])
  reference = trained(tfmgpu.get_strategy("one_device"))
  print("maxdiff", max(float(np.abs(a - b).max()) for a, b in
                       zip(model.get_weights(), reference.get_weights())))
  predictions = tfmgpu.predict(model, X, batch_size=100)
  print("predict", predictions.shape, "maxdiff", float(np.abs(
      predictions - tfmgpu.predict(reference, X)).max()), flush=True)
  # The model's variables (whole) and, under the optimizer, their parts.
  path = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
  print("checkpoint kernels", sorted(
      (k.split("/")[0], tuple(shape)) for k, shape
      in tf.train.list_variables(path) if "kernel" in k))
  model.save(os.path.join(model_dir, "model.keras"))
  loaded = keras.models.load_model(os.path.join(model_dir, "model.keras"))
  print("saved equal", all(np.array_equal(a, b) for a, b in
                           zip(loaded.get_weights(), model.get_weights())),
        flush=True)


if __name__ == "__main__":
  # The ps and worker tasks serve here until the launcher stops them.
  cluster.run_server_if_needed(cluster.task_role(os.environ.get("TF_CONFIG")))
  main(sys.argv[1], int(sys.argv[2]))
