"""A parameter-server run with each variable split over 2 servers, against
one device (run by test_parameter_server.py, under `tfmgpu.launch
--num_workers=1 --num_ps=2 --coordinator`).

argv: the model directory. The chief trains a tiny model with
`variable_shards=2` on one worker (its steps run one after another, as on
one device; whole passes over the rows, which its stream does not restart
each epoch), then the same model on one device in this process, and
prints the largest weight difference and what the checkpoint holds.
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
                              keras.layers.Dense(3)])
  trainer_class = (tfmgpu.ParameterServerTrainer if kwargs
                   else tfmgpu.Trainer)
  trainer = trainer_class(model, strategy=strategy, verbose=0,
                          optimizer="adam", learning_rate=0.05, **kwargs)
  trainer.fit(X, Y, epochs=2, steps_per_epoch=8, global_batch_size=32,
              shuffle=False)
  return model


def main(model_dir):
  split = tfmgpu.get_strategy("parameter_server", variable_shards=2)
  model = trained(split, model_dir=model_dir)
  print("parts", [len(v.value.variables) for v in model.weights])
  reference = trained(tfmgpu.get_strategy("one_device"))
  print("maxdiff", max(float(np.abs(a - b).max()) for a, b in
                       zip(model.get_weights(), reference.get_weights())))
  path = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
  kernel = [k for k, _ in tf.train.list_variables(path)
            if k.startswith("model/") and "kernel" in k][0]
  print("checkpoint kernel", tf.train.load_variable(path, kernel).shape)
  model.save(os.path.join(model_dir, "split.keras"))
  loaded = keras.models.load_model(os.path.join(model_dir, "split.keras"))
  print("saved equal", all(np.array_equal(a, b) for a, b in
                           zip(loaded.get_weights(), model.get_weights())),
        flush=True)


if __name__ == "__main__":
  # The ps and worker tasks serve here until the launcher stops them.
  cluster.run_server_if_needed(cluster.task_role(os.environ.get("TF_CONFIG")))
  main(sys.argv[1])
