"""Checkpoints: save every epoch, resume from the latest, chief-only writes.

Under multi-worker strategies every worker must take part in saving (the
save reads mirrored values collectively), but only the chief's files are
kept: the others write to a temporary directory that is removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from absl import logging
import keras
import tensorflow as tf


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  """True for the task that owns outputs (the only task, or the chief/worker 0)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.task_type:
    return True
  cluster = resolver.cluster_spec().as_dict()
  if "chief" in cluster:
    return resolver.task_type == "chief"
  return resolver.task_type == "worker" and resolver.task_id == 0


class Checkpointer:
  """Wraps `tf.train.CheckpointManager` for the training loop.

  Args:
    model_dir: the run directory; checkpoints go to `model_dir/checkpoints`.
    strategy: the run's strategy (to decide who writes).
    model, optimizer: what is saved, plus the epoch counter.
    max_to_keep: checkpoints kept. Defaults to `3`.
  """

  def __init__(self, model_dir: str, strategy: tf.distribute.Strategy, *,
               model: keras.Model, optimizer: keras.optimizers.Optimizer,
               max_to_keep: int = 3):
    self.chief = is_chief(strategy)
    self._tmp = None if self.chief else tempfile.mkdtemp(prefix="tfmgpu-ckpt-")
    self.directory = (os.path.join(model_dir, "checkpoints") if self.chief
                      else self._tmp)
    self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                          epoch=self.epoch)
    self.manager = tf.train.CheckpointManager(
        self.checkpoint, self.directory, max_to_keep=max_to_keep)

  @property
  def latest(self) -> str | None:
    return self.manager.latest_checkpoint

  def restore_latest(self) -> int:
    """Restores the newest checkpoint if any; returns the epochs it completed."""
    path = self.manager.latest_checkpoint
    if not path:
      return 0
    self.checkpoint.restore(path).assert_existing_objects_matched()
    logging.info("Resumed from %s (epoch %d).", path, int(self.epoch.numpy()))
    return int(self.epoch.numpy())

  def save(self, epoch: int) -> str:
    """Saves after `epoch` completed epochs; returns the path (chief's or temp)."""
    self.epoch.assign(epoch)
    return self.manager.save(checkpoint_number=epoch)

  def close(self) -> None:
    """Removes a non-chief worker's temporary directory."""
    if self._tmp:
      shutil.rmtree(self._tmp, ignore_errors=True)
      self._tmp = None
