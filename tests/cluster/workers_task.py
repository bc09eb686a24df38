"""Both workers of test_workers: `python workers_task.py MODEL_DIR` under a
2-worker multi_worker_mirrored cluster (one replica per worker).

Three fits in turn, each with its own model and `Trainer`, each line
tagged with its fit:
mismatch: worker 1's fit is called with another global batch and seed.
stop: a callback that worker 0 alone has sets `stop_training` after batch 4
(worker 1 has no callbacks at all, as when only the chief logs).
saved: 2 epochs with `model_dir=MODEL_DIR`; the script then exits without
`Trainer.close()`.
"""

import sys

import keras
import numpy as np

import tfmgpu

strategy = tfmgpu.get_strategy("multi_worker_mirrored")
ME = strategy.cluster_resolver.task_id
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = rng.integers(0, 3, size=512).astype("int32")


class StopOnChief(keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if ME == 0 and batch == 3:
      self.model.stop_training = True


def fit(tag, *, callbacks=(), model_dir=None, other=False, **kwargs):
  """A fresh model's fit; prints `tag DONE: ...` or `tag REFUSED: ...`."""
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
  trainer = tfmgpu.Trainer(model, strategy=strategy, verbose=0,
                           callbacks=list(callbacks), model_dir=model_dir)
  try:
    result = trainer.fit(x, y, epochs=2, global_batch_size=32 if other
                         else 64, seed=1 if other else 0, **kwargs)
  except ValueError as e:
    print(f"{tag} REFUSED: {e}", flush=True)
    return
  print(f"{tag} DONE: steps {int(trainer.optimizer.iterations.numpy())} "
        f"epochs {result.epochs_run}", flush=True)


fit("mismatch", other=ME == 1, steps_per_epoch=8)
fit("stop", callbacks=[StopOnChief()] if ME == 0 else [], steps_per_epoch=8)
fit("saved", model_dir=sys.argv[1], steps_per_epoch=2)
