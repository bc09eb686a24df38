"""The distribution wrapper: `strategy.run` + named reductions, in `tf.function`.

The middle of the three layers. It takes per-replica step functions
(`tfmgpu.training.step`) and returns compiled functions that run several
steps per call (`steps_per_execution`) or a whole evaluation pass, reducing
per-replica results with SUM (losses are already averaged over the global
batch, counts add up).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

StepFn = Callable[[tf.Tensor, tf.Tensor], dict[str, tf.Tensor]]


def _reduce_sum(strategy: tf.distribute.Strategy, per_replica):
  return {k: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)
          for k, v in per_replica.items()}


def make_train_function(strategy: tf.distribute.Strategy, step: StepFn
                        ) -> Callable[..., dict[str, tf.Tensor]]:
  """Returns `train(iterator, num_steps) -> summed results of num_steps steps`.

  `num_steps` is a tensor argument, so changing it (e.g. the last, shorter
  call of an epoch) does not retrace.
  """

  def one_step(iterator):
    x, y = next(iterator)
    return _reduce_sum(strategy, strategy.run(step, args=(x, y)))

  @tf.function
  def train(iterator, num_steps):
    totals = one_step(iterator)
    for _ in tf.range(num_steps - 1):
      out = one_step(iterator)
      totals = {k: totals[k] + out[k] for k in totals}
    return totals

  return train


def make_eval_function(strategy: tf.distribute.Strategy, step: StepFn
                       ) -> Callable[..., dict[str, tf.Tensor]]:
  """Returns `evaluate(distributed_dataset) -> summed results over all batches`."""

  @tf.function
  def evaluate(dataset):
    totals = {"loss_sum": tf.constant(0.0), "correct": tf.constant(0.0),
              "count": tf.constant(0.0)}
    for batch in dataset:
      out = _reduce_sum(strategy, strategy.run(step, args=batch))
      totals = {k: totals[k] + tf.cast(out[k], tf.float32) for k in totals}
    return totals

  return evaluate
