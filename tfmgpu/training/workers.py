"""What the workers of a multi-worker mirrored run agree on, and how.

Under `MultiWorkerMirroredStrategy` every worker runs the same collectives
in the same order; a decision one worker takes alone (stop after this
batch, save now) leaves the others waiting in a collective it never joins,
or crashes them. `AnyWorker` turns flags of one worker into the answers of
all: one tiny all-reduce for them all, and none outside a multi-worker run.

Workers started by hand with different settings (another `--seed` or
`--global_batch_size`) trained, silently, weights that no one command asks
for, or hung (another `--epochs`). `require_same_run` gathers each worker's
settings that change what trains (a number each: the value, or a hash of
it) in one all-gather before the first step, and every worker refuses,
naming the settings and each worker's value. `require_same_start` then
checks, after the restore, that every worker resumed from the same
checkpoint: a worker that cannot see the chief's `model_dir` started
afresh beside a resumed chief, and the two trained mixed weights.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import tensorflow as tf

from tfmgpu import strategies as strategies_lib
from tfmgpu.training import checkpoints as ckpt_lib


def is_collective_multi_worker(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` is multi-worker mirrored across several workers."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return False
  return strategies_lib.in_multi_worker_mode(strategy)


class AnyWorker:
  """`any_worker(flag)`: whether `flag` holds on any worker (`each`: of
  several flags at once).

  Under multi-worker mirrored it is one all-reduce, so every worker must
  call it as often, at the same point and with as many flags; elsewhere it
  is `bool(flag)`.

  Args:
    strategy: the run's strategy.
  """

  def __init__(self, strategy: tf.distribute.Strategy):
    self.collective = is_collective_multi_worker(strategy)
    self._agree = None
    if self.collective:
      @tf.function
      def agree(flag):
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                               axis=None)
      self._agree = agree

    self._strategy, self._gather = strategy, None

  def __call__(self, flag: bool) -> bool:
    return self.each(flag)[0]

  def each(self, *flags: bool) -> tuple[bool, ...]:
    """Whether each of `flags` holds on any worker: one all-reduce of them
    all (a callback's `stop_training` and SIGTERM after a step), none
    outside a multi-worker run."""
    if self._agree is None:
      return tuple(bool(f) for f in flags)
    summed = self._agree(tf.constant([1.0 if f else 0.0 for f in flags]))
    return tuple(bool(v > 0) for v in np.asarray(summed))

  def rows(self, values: np.ndarray) -> np.ndarray:
    """Every worker's `values` (int64), one row per worker in task order:
    one all-gather (multi-worker only)."""
    strategy = self._strategy
    if self._gather is None:
      @tf.function
      def gather(row):
        per_replica = strategy.run(lambda r: tf.expand_dims(r, 0),
                                   args=(row,))
        return strategy.gather(per_replica, axis=0)
      self._gather = gather
    table = self._gather(tf.constant(values, tf.int64)).numpy()
    return table[::max(len(strategy.extended.worker_devices), 1)]


class WorkersDisagreeError(ValueError):
  """The workers of one multi-worker run were given different settings."""


# Trainer options that change what trains or which collectives run.
_OPTIONS = ("optimizer", "learning_rate", "clip_norm", "gradient_compression",
            "bytes_per_pack", "loss", "metrics", "loss_weights",
            "weighted_metrics", "steps_per_execution", "jit_compile",
            "batch_splits", "fused_optimizer", "input_mode",
            "checkpoint_every_steps", "checkpoint_every_s", "zero_stage")
_NONE, _INT, _FLOAT, _TEXT = range(4)


def _describe(value: Any) -> str:
  """Words for `value` that are the same in every process (no addresses)."""
  if value is None or isinstance(value, (str, bool, int, float)):
    return repr(value)
  if isinstance(value, dict):
    return "{" + ", ".join(f"{_describe(k)}: {_describe(v)}" for k, v in
                           sorted(value.items(), key=lambda kv: str(kv[0]))
                           ) + "}"
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(_describe(v) for v in value) + "]"
  named = value if callable(value) and hasattr(value, "__qualname__") else (
      type(value))
  return f"{named.__module__}.{named.__qualname__}"


def _encode(value: Any) -> tuple[int, int]:
  """(kind, payload): a number as itself, anything else hashed."""
  if value is None:
    return _NONE, 0
  if isinstance(value, (bool, int, np.integer)) and abs(int(value)) < 2**62:
    return _INT, int(value)
  if isinstance(value, (float, np.floating)):
    return _FLOAT, struct.unpack("<q", struct.pack("<d", float(value)))[0]
  digest = hashlib.blake2b(_describe(value).encode(), digest_size=8).digest()
  return _TEXT, struct.unpack("<q", digest)[0]


def _shown(kind: int, payload: int) -> str:
  if kind == _NONE:
    return "None"
  if kind == _FLOAT:
    return f"{struct.unpack('<d', struct.pack('<q', payload))[0]:g}"
  return str(payload) if kind == _INT else f"#{payload & 0xffff:04x}"


def _data_shapes(source: Any) -> str:
  """The training data's shapes and dtypes (not its values: two hosts may
  round a preprocessing apart), so another dataset is told apart."""
  if hasattr(source, "num_examples"):  # inputs.ArrayData
    leaves = tf.nest.flatten(source.data)
    return f"{source.num_examples} rows: " + ", ".join(
        f"{tuple(np.shape(a)[1:])} {np.asarray(a[:1]).dtype}" for a in leaves)
  if hasattr(source, "dataset"):  # inputs.DatasetData
    return repr(source.dataset.element_spec)
  return "a dataset function"


def fit_settings(trainer: Any, plan: Any, *, epochs: int, seed: int,
                 shuffle: bool, validation: Any) -> dict[str, Any]:
  """The settings of one `Trainer.fit` that every worker must share."""
  weights = trainer.model.weights
  settings = {
      "global_batch_size": plan.global_batch_size,
      "steps_per_epoch": plan.steps_per_epoch, "epochs": epochs,
      "seed": seed, "shuffle": shuffle,
      "validation_data given": validation is not None,
      "model_dir given": trainer.options.model_dir is not None,
      "model parameters": int(sum(np.prod(w.shape) for w in weights)),
      "model weights (shapes, dtypes)": [
          (tuple(w.shape), str(w.dtype), bool(w.trainable)) for w in weights],
      "training data (shapes)": _data_shapes(plan.source)}
  settings.update({name: getattr(trainer.options, name) for name in _OPTIONS})
  return settings


def require_same_run(any_worker: AnyWorker, settings: dict[str, Any]) -> None:
  """Every worker was given the same `settings` (`fit_settings`), or every
  worker raises. Nothing outside a multi-worker run.

  Raises:
    WorkersDisagreeError: naming each differing setting and every worker's
      value (or, for a hashed one, this worker's).
  """
  if not any_worker.collective:
    return
  mine = [_encode(v) for v in settings.values()]
  rows = any_worker.rows(np.array(mine, np.int64).reshape(-1))
  rows = rows.reshape(len(rows), len(mine), 2)
  differ = []
  for i, name in enumerate(settings):
    if (rows[:, i] == rows[0, i]).all():
      continue
    values = ", ".join(f"worker {w}: {_shown(*row[i])}"
                       for w, row in enumerate(rows))
    if any(row[i][0] == _TEXT for row in rows):
      values += f"; this worker's: {_describe(settings[name])[:200]}"
    differ.append(f"{name} ({values})")
  if any(d.startswith("steps_per_epoch ") for d in differ):
    differ.append("(without steps_per_epoch= each worker counts the "
                  "batches of its own input, and they differ: pass "
                  "steps_per_epoch=N)")
  if differ:
    raise WorkersDisagreeError(
        "The workers of this multi_worker_mirrored run were given different "
        f"settings: {'; '.join(differ)}. Trained so, they would compute "
        "other weights than any one of them asks for (or wait forever for "
        "each other), so every worker stops before the first step. Start "
        "every worker with the same command and arguments, differing only "
        "in TF_CONFIG's task (python -m tfmgpu.launch does so).")


def _start_words(row: np.ndarray) -> str:
  """A worker's start (`start_row`) in words."""
  number, epoch, epoch_step, step = (int(v) for v in row)
  if number < 0:
    return "no checkpoint (a fresh start)"
  where = ckpt_lib.Progress(epoch, epoch_step, step)
  return f"ckpt-{number} ({ckpt_lib.describe_position(where)})"


def require_same_start(any_worker: Any, checkpointer: ckpt_lib.Checkpointer
                       ) -> None:
  """Every worker restored the same checkpoint (`checkpointer.restored`, at
  the same position), or every worker raises. Nothing outside a
  multi-worker run (`any_worker` an `AnyWorker` there).

  A worker that cannot see the chief's `model_dir` (its own disk) starts
  afresh while the chief resumes: they trained in lock-step, silently,
  weights mixed of both, or crashed in a collective of another shape.

  Raises:
    WorkersDisagreeError: naming each worker's checkpoint and position.
  """
  if not getattr(any_worker, "collective", False):  # `bool` off a run.
    return
  restored = checkpointer.restored
  p = checkpointer.progress if restored else ckpt_lib.Progress()
  mine = [ckpt_lib.number_of(restored) if restored else -1, p.epoch,
          p.epoch_step, p.step]
  rows = any_worker.rows(np.array(mine, np.int64))
  if (rows == rows[0]).all():
    return
  starts = "; ".join(f"worker {w}: {_start_words(row)}"
                     for w, row in enumerate(rows))
  raise WorkersDisagreeError(
      "The workers of this multi_worker_mirrored run resumed from different "
      f"checkpoints: {starts}. Trained so, they would mix the weights of "
      "both starts (or crash in a collective), so every worker stops before "
      "the first step. Every worker must see the chief's --model_dir: put "
      "it on a filesystem every host shares (NFS, a cloud bucket), at a path "
      "each worker is given (this worker read "
      f"{checkpointer.chief_directory}), then run the same command again: "
      "the checkpoints are left as they are.")
