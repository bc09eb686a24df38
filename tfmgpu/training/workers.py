"""What the workers of a multi-worker mirrored run agree on, and how.

Under `MultiWorkerMirroredStrategy` every worker runs the same collectives
in the same order; a decision one worker takes alone (stop after this
batch, save now) leaves the others waiting in a collective it never joins,
or crashes them. `AnyWorker` turns a flag of one worker into the answer of
all: one tiny all-reduce, and none at all outside a multi-worker run.
"""

from __future__ import annotations

import tensorflow as tf

from tfmgpu import strategies as strategies_lib


def is_collective_multi_worker(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` is multi-worker mirrored across several workers."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return False
  return strategies_lib.in_multi_worker_mode(strategy)


class AnyWorker:
  """`any_worker(flag)`: whether `flag` holds on any worker.

  Under multi-worker mirrored it is one all-reduce, so every worker must
  call it as often and at the same point; elsewhere it is `bool(flag)`.

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

  def __call__(self, flag: bool) -> bool:
    if self._agree is None:
      return bool(flag)
    return float(self._agree(tf.constant(1.0 if flag else 0.0))) > 0
