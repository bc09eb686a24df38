"""One worker of test_workers: `python workers_task.py MODE` under a
2-worker multi_worker_mirrored cluster (one replica per worker).

stop: a callback that worker 0 alone has sets `stop_training` after batch 4
(worker 1 has no callbacks at all, as when only the chief logs).
mismatch: worker 1's fit is called with another global batch and seed.
"""

import sys

import keras
import numpy as np

import tfmgpu

strategy = tfmgpu.get_strategy("multi_worker_mirrored")
ME = strategy.cluster_resolver.task_id
MODE = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = rng.integers(0, 3, size=512).astype("int32")
with strategy.scope():
  model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])


class StopOnChief(keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if ME == 0 and batch == 3:
      self.model.stop_training = True


trainer = tfmgpu.Trainer(model, strategy=strategy, verbose=0,
                         callbacks=([StopOnChief()] if MODE == "stop"
                                    and ME == 0 else []))
other = MODE == "mismatch" and ME == 1
try:
  result = trainer.fit(x, y, epochs=2, steps_per_epoch=8,
                       global_batch_size=32 if other else 64,
                       seed=1 if other else 0)
except ValueError as e:
  print(f"REFUSED: {e}", flush=True)
  sys.exit(3)
print(f"DONE: steps {int(trainer.optimizer.iterations.numpy())} epochs "
      f"{result.epochs_run}", flush=True)
