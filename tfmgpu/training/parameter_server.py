"""Parameter-server training: the coordinator schedules steps on the workers.

`ParameterServerTrainer` is `Trainer` for `ParameterServerStrategy`, which
Keras 3 `model.fit` does not support. It runs in the coordinator (the
"chief" task); the "ps" tasks hold the variables and the "worker" tasks only
run servers (`tfmgpu.cluster.run_server`). Each epoch the coordinator
schedules `steps_per_epoch` steps with `ClusterCoordinator.schedule` (in
functions of `steps_per_execution` steps) and joins them in chunks, so a
SIGTERM to the coordinator saves a checkpoint within a chunk. Evaluation runs
on the coordinator, reading the variables from the parameter servers.

Training is asynchronous: each worker applies its own gradients to the
variables as soon as it has them, so which worker runs which step (and so
the exact model) changes from run to run; step counts and checkpoints are
exact (they are taken after a join). Each worker reads the whole training set
repeatedly, in its own shuffled order: TensorFlow gives a per-worker dataset
function no worker index to shard by, so the shuffle is seeded from each
worker's clock.
"""

from __future__ import annotations

import contextlib
import math
import time

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import preemption as preemption_lib
from tfmgpu.training import step as step_lib
from tfmgpu.training.loop import NonFiniteLossError
from tfmgpu.training.loop import steps_in_one_pass
from tfmgpu.training.loop import Trainer
from tfmgpu.training.loop import TrainResult

# Scheduled functions per worker between two joins: bounds how long a SIGTERM
# waits for a checkpoint, at the cost of an idle moment per join.
CALLS_PER_WORKER_PER_JOIN = 4


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` is a `ParameterServerStrategy` (needs this trainer)."""
  return isinstance(strategy,
                    tf.distribute.experimental.ParameterServerStrategy)


class ParameterServerTrainer(Trainer):
  """Trains a Keras model on a parameter-server cluster, from the coordinator.

  Takes the arguments of `Trainer`; `strategy` must be a
  `ParameterServerStrategy` (`tfmgpu.get_strategy("parameter_server")`) and
  the model must be built in its scope. Keras callbacks get the train and
  epoch hooks, not the batch hooks.

  Example (in the "chief" task of a cluster with "ps" and "worker" jobs):
    strategy = tfmgpu.get_strategy("parameter_server")
    with strategy.scope():
      model = tfmgpu.models.build_model("convnet", input_shape=(28, 28, 1),
                                        num_classes=10)
    trainer = ParameterServerTrainer(model, strategy=strategy)
    trainer.fit(x, y, epochs=3, global_batch_size=64)
    print(trainer.evaluate(x_test, y_test))

  Raises:
    ValueError: `strategy` is not a `ParameterServerStrategy`.
  """

  def __init__(self, model: keras.Model, *,
               strategy: tf.distribute.Strategy, **kwargs):
    if not is_parameter_server(strategy):
      raise ValueError(
          f"ParameterServerTrainer needs a ParameterServerStrategy; got "
          f"strategy={type(strategy).__name__}. Use tfmgpu.get_strategy("
          "'parameter_server') in the chief task, or Trainer for other "
          "strategies.")
    super().__init__(model, strategy=strategy, **kwargs)
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    self.num_workers = getattr(strategy, "_num_workers", 1)  # No public API.

  def _per_worker_iterator(self, x: np.ndarray, y: np.ndarray,
                           global_batch_size: int, shuffle: bool):
    """An iterator on each worker over its own endless shuffled stream."""

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
      features, labels = tf.constant(x), tf.constant(y)
      n = len(x)
      # Seeded from the worker's clock so that workers differ (a fixed or
      # global seed would give every worker the same order).
      clock = tf.cast(tf.timestamp() * 1e6, tf.int64)

      def one_pass(epoch):
        order = tf.range(n, dtype=tf.int64)
        if shuffle:
          order = tf.random.experimental.stateless_shuffle(
              order, seed=tf.stack([clock, epoch]))
        return tf.data.Dataset.from_tensor_slices(order)

      ds = tf.data.Dataset.range(2**62).flat_map(one_pass).map(
          lambda i: (tf.gather(features, i), tf.gather(labels, i)))
      ds = ds.batch(ctx.get_per_replica_batch_size(global_batch_size),
                    drop_remainder=True)
      return ds.prefetch(tf.data.AUTOTUNE)

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    return iter(self.coordinator.create_per_worker_dataset(
        per_worker_dataset_fn))

  def evaluate(self, x: np.ndarray, y: np.ndarray, *,
               global_batch_size: int = 256) -> dict[str, float]:
    """Loss and accuracy over every example of `(x, y)`, on the coordinator.

    Returns:
      `{"loss": mean loss, "accuracy": fraction correct, "count": rows}`.
    """
    if self._eval_fn is None:
      step = step_lib.make_eval_step(self.model, loss=self.loss)

      @tf.function
      def evaluate(dataset):
        totals = {"loss_sum": tf.constant(0.0), "correct": tf.constant(0.0),
                  "count": tf.constant(0.0)}
        for batch in dataset:
          out = step(*batch)
          totals = {k: totals[k] + tf.cast(out[k], tf.float32) for k in totals}
        return totals

      self._eval_fn = evaluate
    mask = np.ones(len(x), np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(
        global_batch_size)
    out = {k: float(v) for k, v in self._eval_fn(dataset).items()}
    n = max(out["count"], 1.0)
    return {"loss": out["loss_sum"] / n, "accuracy": out["correct"] / n,
            "count": out["count"]}

  def fit(self, x: np.ndarray, y: np.ndarray, *, epochs: int = 1,
          global_batch_size: int = 64, steps_per_epoch: int | None = None,
          validation_data: tuple[np.ndarray, np.ndarray] | None = None,
          seed: int = 0, shuffle: bool = True) -> TrainResult:
    """Trains for `epochs` (resuming from `model_dir` if it has checkpoints).

    Arguments and errors as `Trainer.fit`; `seed` is unused (each worker
    shuffles in its own order, see the module docstring). Each step trains
    on `global_batch_size` examples on one worker.
    """
    del seed  # Workers shuffle independently.
    steps_per_epoch = steps_per_epoch or steps_in_one_pass(
        len(x), epochs=epochs, global_batch_size=global_batch_size)
    watching = (preemption_lib.PreemptionWatcher(self.strategy)
                if self.model_dir else contextlib.nullcontext())
    with watching as watcher:
      return self._fit(x, y, watcher, epochs=epochs,
                       global_batch_size=global_batch_size,
                       steps_per_epoch=steps_per_epoch,
                       validation_data=validation_data, shuffle=shuffle)

  def _fit(self, x, y, watcher, *, epochs, global_batch_size, steps_per_epoch,
           validation_data, shuffle) -> TrainResult:
    checkpointer = self._checkpoints()
    initial_epoch = checkpointer.restore_latest() if checkpointer else 0
    progress = checkpointer.progress if checkpointer else ckpt_lib.Progress()
    global_step = progress.step
    last_ckpt = checkpointer.latest if checkpointer else None
    train_fn = self._train_fn(global_batch_size)
    iterator = self._per_worker_iterator(x, y, global_batch_size, shuffle)
    chunk = CALLS_PER_WORKER_PER_JOIN * self.num_workers
    callbacks = keras.callbacks.CallbackList(
        self.callbacks, add_history=False, add_progbar=False, model=self.model,
        epochs=epochs, steps=steps_per_epoch, verbose=0)
    writer = self._summary_writer()
    history: dict[str, list[float]] = {}
    total_steps, seconds = 0, 0.0
    self.model.stop_training = False
    callbacks.on_train_begin()
    for epoch in range(initial_epoch, epochs):
      callbacks.on_epoch_begin(epoch)
      first_step = progress.epoch_step if epoch == initial_epoch else 0
      done, loss_sum, correct, count = first_step, 0.0, 0.0, 0.0
      bar = (keras.utils.Progbar(steps_per_epoch, stateful_metrics=[
          "loss", "accuracy"]) if self.verbose else None)
      if bar is not None:
        print(f"Epoch {epoch + 1}/{epochs}", flush=True)
      while done < steps_per_epoch:
        start = time.perf_counter()
        scheduled, results = 0, []
        while len(results) < chunk and done + scheduled < steps_per_epoch:
          n = min(self.steps_per_execution,
                  steps_per_epoch - done - scheduled)
          results.append(self.coordinator.schedule(
              train_fn, args=(iterator, tf.constant(n))))
          scheduled += n
        self.coordinator.join()
        seconds += time.perf_counter() - start
        outs = [r.fetch() for r in results]
        chunk_loss = sum(float(o["loss"]) for o in outs)
        if (not math.isfinite(chunk_loss) or
            any(float(o["non_finite"]) for o in outs)):
          raise NonFiniteLossError(
              f"Loss became non-finite in steps {global_step + 1}-"
              f"{global_step + scheduled} (epoch {epoch + 1}). Training "
              f"stopped; the last good checkpoint is "
              f"{last_ckpt or 'none (no model_dir)'}. Lower the learning "
              "rate or set clip_norm.")
        loss_sum += chunk_loss
        correct += sum(float(o["correct"]) for o in outs)
        count += sum(float(o["count"]) for o in outs)
        done += scheduled
        total_steps += scheduled
        global_step += scheduled
        logs = {"loss": loss_sum / (done - first_step),
                "accuracy": correct / max(count, 1.0)}
        if bar is not None:
          bar.update(done, values=list(logs.items()))
        with writer.as_default(step=global_step):
          tf.summary.scalar("train/loss", chunk_loss / scheduled)
        if watcher and watcher.received and done < steps_per_epoch:
          path = checkpointer.save(epoch, step=global_step, epoch_step=done)
          raise ckpt_lib.PreemptedError(
              f"Preempted: SIGTERM reached the coordinator. Saved {path} at "
              f"global step {global_step} ({done} of {steps_per_epoch} steps "
              f"into epoch {epoch + 1}). Run the same command again to resume "
              f"(python -m tfmgpu.train exits with code "
              f"{ckpt_lib.EXIT_PREEMPTED}).", checkpoint=path,
              step=global_step)
      last_ckpt = self._finish_epoch(
          epoch, epochs, logs, history=history, callbacks=callbacks,
          writer=writer, checkpointer=checkpointer, global_step=global_step,
          validation_data=validation_data, global_batch_size=global_batch_size,
          examples_per_sec=(total_steps * global_batch_size / seconds
                            if seconds else 0.0)) or last_ckpt
      if watcher and watcher.received and epoch + 1 < epochs:
        raise ckpt_lib.PreemptedError(
            f"Preempted: SIGTERM reached the coordinator. Saved {last_ckpt} "
            f"at global step {global_step} (the end of epoch {epoch + 1}). "
            "Run the same command again to resume (python -m tfmgpu.train "
            f"exits with code {ckpt_lib.EXIT_PREEMPTED}).",
            checkpoint=last_ckpt, step=global_step)
      if self.model.stop_training:
        break
    callbacks.on_train_end(history)
    writer.flush()
    return TrainResult(
        history=history, epochs_run=len(history.get("loss", [])),
        initial_epoch=initial_epoch, steps=total_steps,
        examples_per_sec=(total_steps * global_batch_size / seconds
                          if seconds else 0.0),
        checkpoint=last_ckpt, initial_step=progress.step)
