"""Catch SIGTERM (preemption notice) and agree on it across workers.

`PreemptionWatcher` records SIGTERM while training runs. At a step boundary
the loop asks `stop_requested()`; under a multi-worker collective strategy
the answer is all-reduced over the workers, so every worker stops (and
saves) after the same step even though only one received the signal.

Why not `tf.distribute.experimental.PreemptionCheckpointHandler`: it counts
its own `run` calls rather than steps, restores through a CheckpointManager
of its own, does nothing on GCP CPU VMs and refuses parameter-server
clusters. One tiny all-reduce per `tf.function` call does the same job
through the existing `Checkpointer`.
"""

from __future__ import annotations

import signal
import threading

from absl import logging
import tensorflow as tf

from tfmgpu import strategies as strategies_lib


def _is_collective_multi_worker(strategy: tf.distribute.Strategy) -> bool:
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return False
  return strategies_lib.in_multi_worker_mode(strategy)


class PreemptionWatcher:
  """A context manager that turns SIGTERM into a flag checked between steps.

  Example:
    with PreemptionWatcher(strategy) as watcher:
      for ...:
        train_fn(...)
        if watcher.stop_requested():
          save(); raise PreemptedError(...)

  The previous SIGTERM handler is restored on exit. Outside the main thread
  (where Python cannot install signal handlers) it watches nothing.

  Args:
    strategy: the run's strategy; under multi-worker mirrored, every worker
      must call `stop_requested()` the same number of times.
  """

  def __init__(self, strategy: tf.distribute.Strategy):
    self.strategy = strategy
    self._received = threading.Event()
    self._previous = None
    self._installed = False
    self._agree = None
    if _is_collective_multi_worker(strategy):
      @tf.function
      def agree(flag):
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                               axis=None)
      self._agree = agree

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    if not self._received.is_set():
      logging.warning("SIGTERM received: saving a checkpoint at the next step "
                      "boundary, then stopping.")
    self._received.set()

  def __enter__(self) -> "PreemptionWatcher":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True
    else:
      logging.info("Not in the main thread: SIGTERM will not be caught.")
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous)
      self._installed = False

  @property
  def received(self) -> bool:
    """Whether this process received SIGTERM."""
    return self._received.is_set()

  def stop_requested(self) -> bool:
    """Whether any worker received SIGTERM (collective under multi-worker)."""
    if self._agree is None:
      return self.received
    flag = tf.constant(1.0 if self.received else 0.0)
    return float(self._agree(flag)) > 0
