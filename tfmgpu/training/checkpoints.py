"""Checkpoints: save every epoch (and on preemption), resume, chief-only writes.

A checkpoint holds the model, the optimizer and the training position: the
epochs completed, the steps done in the next epoch, and the global step.
`ckpt-N` belongs to epoch N: it is written when epoch N completes, or
partway through epoch N when the job is preempted (and then overwritten when
the resumed job completes that epoch). A resumed run skips the steps already
done in its first epoch, so with the same `global_batch_size` it sees exactly
the data of an uninterrupted run (`data.epoch_order`), whatever the number of
workers or replicas.

Preemption: while `Trainer.fit` runs with a `model_dir`, SIGTERM (what
schedulers send before they kill a job) is caught; at the next step boundary
every worker saves a checkpoint and `fit` raises `PreemptedError`. The CLI
(`python -m tfmgpu.train`) then exits with `EXIT_PREEMPTED` (42): rerun the
same command to resume from the saved step. A worker killed without notice
(SIGKILL, a crashed host) leaves the last checkpoint written.

Multi-worker: every worker restores from the chief's directory
(`model_dir/checkpoints`, which must be on a filesystem all workers see) and
takes part in saving, but only the chief's files are kept: the others write
to a temporary directory that `close()` removes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

from absl import logging
import keras
import tensorflow as tf

# Exit code of `python -m tfmgpu.train` when SIGTERM stopped training after a
# checkpoint was saved: "preempted, restart me". (143 = 128 + SIGTERM means a
# process died of SIGTERM without saving.)
EXIT_PREEMPTED = 42


class PreemptedError(RuntimeError):
  """Training stopped on SIGTERM after saving a checkpoint; rerun to resume.

  Attributes:
    checkpoint: the checkpoint saved (the chief's path; a temporary path on
      other workers).
    step: the global step saved.
  """

  def __init__(self, message: str, *, checkpoint: str | None, step: int):
    super().__init__(message)
    self.checkpoint = checkpoint
    self.step = step


@dataclasses.dataclass(frozen=True)
class Progress:
  """Where training stands.

  Attributes:
    epoch: epochs completed.
    epoch_step: steps done in the next epoch (0 at an epoch boundary).
    step: optimizer steps done in all (the global step).
  """
  epoch: int = 0
  epoch_step: int = 0
  step: int = 0


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
    model, optimizer: what is saved, plus the training position.
    max_to_keep: checkpoints kept. Defaults to `3`.
  """

  def __init__(self, model_dir: str, strategy: tf.distribute.Strategy, *,
               model: keras.Model, optimizer: keras.optimizers.Optimizer,
               max_to_keep: int = 3):
    self.chief = is_chief(strategy)
    # Every worker resumes from the chief's checkpoints.
    self.chief_directory = os.path.join(model_dir, "checkpoints")
    self._tmp = None if self.chief else tempfile.mkdtemp(prefix="tfmgpu-ckpt-")
    self.directory = self.chief_directory if self.chief else self._tmp
    self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    self.epoch_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  name="epoch_step")
    self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    self.checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, epoch=self.epoch,
        epoch_step=self.epoch_step, step=self.step)
    self.manager = tf.train.CheckpointManager(
        self.checkpoint, self.directory, max_to_keep=max_to_keep)

  @property
  def latest(self) -> str | None:
    """The newest checkpoint of the run (the chief's copy, which is kept)."""
    if self.chief:
      return self.manager.latest_checkpoint
    return tf.train.latest_checkpoint(self.chief_directory)

  @property
  def progress(self) -> Progress:
    """The position saved in (or restored from) the checkpoint."""
    return Progress(int(self.epoch.numpy()), int(self.epoch_step.numpy()),
                    int(self.step.numpy()))

  def restore_latest(self) -> int:
    """Restores the chief's newest checkpoint if any; returns epochs completed.

    `progress` then says how far into the next epoch it was saved.
    """
    path = tf.train.latest_checkpoint(self.chief_directory)
    if not path:
      return 0
    self.checkpoint.restore(path).assert_existing_objects_matched()
    p = self.progress
    logging.info("Resumed from %s: epoch %d, step %d of it, global step %d.",
                 path, p.epoch + (1 if p.epoch_step else 0), p.epoch_step,
                 p.step)
    return p.epoch

  def save(self, epoch: int, *, step: int | None = None,
           epoch_step: int = 0) -> str:
    """Saves the position; returns the path (the chief's, or a temporary one).

    Args:
      epoch: epochs completed.
      step: the global step. Defaults to the last one saved or restored.
      epoch_step: steps done in epoch `epoch + 1` (a preemption mid-epoch);
        `0` at an epoch end. The file is `ckpt-<epoch>` at an epoch end and
        `ckpt-<epoch + 1>` mid-epoch.
    """
    self.epoch.assign(epoch)
    self.epoch_step.assign(epoch_step)
    if step is not None:
      self.step.assign(step)
    return self.manager.save(
        checkpoint_number=epoch + (1 if epoch_step else 0))

  def chief_path(self, path: str) -> str:
    """The chief's copy of checkpoint `path` (the one that is kept)."""
    return os.path.join(self.chief_directory, os.path.basename(path))

  def close(self) -> None:
    """Removes a non-chief worker's temporary directory."""
    if self._tmp:
      shutil.rmtree(self._tmp, ignore_errors=True)
      self._tmp = None
