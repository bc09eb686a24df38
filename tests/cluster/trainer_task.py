"""A Python run of `Trainer(model_dir=...)` on each worker of a
multi_worker_mirrored cluster (run by test_multi_worker.py under
`tfmgpu.launch --num_workers=2`), which exits without `Trainer.close()`.

argv: the model directory.
"""

import sys

import keras
import numpy as np

import tfmgpu


def main(model_dir):
  strategy = tfmgpu.get_strategy("multi_worker_mirrored")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  y = rng.integers(0, 2, 64)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  trainer = tfmgpu.Trainer(model, strategy=strategy, verbose=0,
                           model_dir=model_dir)
  trainer.fit(x, y, epochs=2, global_batch_size=32)
  print("trained", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
