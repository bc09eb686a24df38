"""The distribution wrapper: `strategy.run` + named reductions, in `tf.function`.

The middle of the three layers. It takes per-replica step functions
(`tfmgpu.training.step`) and returns compiled functions that run several
steps per call (`steps_per_execution`) or a whole evaluation pass, reducing
per-replica results with SUM (losses are already averaged over the global
batch, counts add up).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import tensorflow as tf

from tfmgpu.training import feeds
from tfmgpu.training import resident

StepFn = Callable[..., dict[str, tf.Tensor]]
Shapes = Mapping[str, tuple[int, ...]]

TRAIN_KEYS = ("loss", "loss_rows", "count", "non_finite")
EVAL_KEYS = ("loss_sum", "count")


def compiled(fn: Callable[..., Any], **options) -> Callable[..., Any]:
  """`tf.function(fn, **options)` with a retracing count of its own.

  TF counts traces by the Python code object, which every function a
  factory makes shares: a notebook's sixth Trainer (or Predictor) would be
  warned of "retracing" though each function traced once. A partial is a
  new object.
  """
  return tf.function(functools.partial(fn), **options)


def _reduce_sum(strategy: tf.distribute.Strategy, per_replica):
  return {k: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)
          for k, v in per_replica.items()}


def sum_shapes(keys: Sequence[str], extra: Shapes | None) -> dict[str, tuple]:
  """Scalar `keys` plus the shaped `extra` sums (metric states)."""
  shapes = {k: () for k in keys}
  shapes.update(extra or {})
  return shapes


def _zeros(shapes: Shapes) -> dict[str, tf.Tensor]:
  return {k: tf.zeros(shape, tf.float32) for k, shape in shapes.items()}


def _add(totals: dict[str, tf.Tensor], out: Mapping[str, tf.Tensor]
         ) -> dict[str, tf.Tensor]:
  return {k: totals[k] + tf.cast(out[k], tf.float32) for k in totals}


class _ReplicaSums:
  """Per-replica running sums that are read (SUM over replicas) once per call.

  Accumulating in replica-local (`ON_READ`) variables means a multi-step
  call adds no cross-device traffic for its metrics: only the gradients are
  all-reduced at every step.
  """

  def __init__(self, strategy: tf.distribute.Strategy, shapes: Shapes):
    with strategy.scope():
      self.vars = {k: tf.Variable(
          tf.zeros(shape, tf.float32), trainable=False,
          name="sum_" + k.replace("/", "_"),
          synchronization=tf.VariableSynchronization.ON_READ,
          aggregation=tf.VariableAggregation.SUM)
                   for k, shape in shapes.items()}

  def reset(self):
    for v in self.vars.values():
      v.assign(tf.zeros_like(v))

  def add(self, values):
    for k, v in self.vars.items():
      v.assign_add(tf.cast(values[k], tf.float32))

  def read(self, check_fn: Callable[[], tf.Tensor] | None = None):
    """The sums over replicas; `check_fn()`'s count added to
    `non_finite`."""
    totals = {k: v.read_value() for k, v in self.vars.items()}
    if check_fn is not None:
      totals["non_finite"] += tf.cast(check_fn(), tf.float32)
    return totals


def make_train_function(strategy: tf.distribute.Strategy, step: StepFn, *,
                        check_fn: Callable[[], tf.Tensor] | None = None,
                        feed: str = feeds.ITERATOR,
                        metric_shapes: Shapes | None = None
                        ) -> Callable[..., dict[str, tf.Tensor]]:
  """Returns `train(batches, num_steps) -> sums over num_steps steps`.

  `num_steps` is a tensor (a shorter last call does not retrace).
  Per-replica results are summed in replica-local variables and reduced
  once at the end of the call.

  Args:
    strategy: the strategy the step runs under.
    step: per-replica `step(x, y[, sample_weight]) -> dict` with the keys of
      `TRAIN_KEYS` and of `metric_shapes`.
    check_fn: run once at the end of each call in cross-replica context; its
      result is added to `non_finite` (e.g. a check that weights are finite).
    feed: what `batches` is (`tfmgpu.training.feeds`): a distributed
      iterator (`ITERATOR`), `resident.EpochBatches.from_step(first_step)`
      (`DEVICE`), or a plain iterator of global batches (`HOST_SPLIT`).
    metric_shapes: the shapes of the step's metric state changes
      (`Objective.state_shapes`), summed like the loss.
  """
  sums = _ReplicaSums(strategy, sum_shapes(TRAIN_KEYS, metric_shapes))

  def replica_step(*batch, **kwargs):
    sums.add(step(*batch, **kwargs))

  def replica_gather_step(data, index, step_in_epoch):
    replica_step(*resident.gather_batch(data, index, step_in_epoch))

  def train_from_iterator(iterator, num_steps):
    strategy.run(sums.reset)
    for _ in tf.range(num_steps):
      strategy.run(replica_step, args=tuple(next(iterator)))
    return sums.read(check_fn)

  def train_from_device_data(batches, num_steps):
    data, index, first_step = batches
    strategy.run(sums.reset)
    for i in tf.range(num_steps):
      strategy.run(replica_gather_step, args=(data, index, first_step + i))
    return sums.read(check_fn)

  def train_split_on_host(iterator, num_steps):
    strategy.run(sums.reset)
    for _ in tf.range(num_steps):
      batch = tuple(next(iterator))
      strategy.run(replica_step, args=feeds.split_batch(strategy, batch),
                   kwargs={"global_batch": feeds.rows_of(batch)})
    return sums.read(check_fn)

  return compiled({feeds.ITERATOR: train_from_iterator,
                    feeds.DEVICE: train_from_device_data,
                    feeds.HOST_SPLIT: train_split_on_host}[feed])


def make_scheduled_train_function(
    strategy: tf.distribute.Strategy, step: StepFn, *,
    check_fn: Callable[[], tf.Tensor] | None = None,
    metric_shapes: Shapes | None = None
) -> Callable[..., dict[str, tf.Tensor]]:
  """`train(iterator, num_steps) -> sums` for `ClusterCoordinator.schedule`.

  Under parameter servers several workers run the function at once, and
  variables created in the strategy's scope live on the servers, shared by
  all of them: sums kept in variables would mix the workers' calls. Here
  they are loop-carried tensors, local to each call (one replica per
  worker, so the per-step reduction moves no data).

  Args:
    strategy: the `ParameterServerStrategy`.
    step: per-replica `step(x, y[, sample_weight]) -> dict`.
    check_fn: as for `make_train_function`.
    metric_shapes: as for `make_train_function`.
  """
  shapes = sum_shapes(TRAIN_KEYS, metric_shapes)

  def train(iterator, num_steps):
    totals = _zeros(shapes)
    for _ in tf.range(num_steps):
      batch = tuple(next(iterator))
      totals = _add(totals, _reduce_sum(strategy,
                                        strategy.run(step, args=batch)))
    if check_fn is not None:
      totals["non_finite"] += tf.cast(check_fn(), tf.float32)
    return totals

  return compiled(train)


def make_eval_function(strategy: tf.distribute.Strategy, step: StepFn, *,
                       replicated: bool = True, split_on_host: bool = False,
                       metric_shapes: Shapes | None = None
                       ) -> Callable[..., dict[str, tf.Tensor]]:
  """Returns `evaluate(dataset) -> summed results over all batches`.

  Args:
    strategy: the strategy the step runs under.
    step: per-replica `step(x, y, mask[, sample_weight]) -> dict`
      (`step.make_eval_step`).
    replicated: `dataset` is distributed and each batch runs on every
      replica (`strategy.run` + SUM); `False` runs each batch of a plain
      dataset right here (a parameter-server coordinator, which reads the
      variables from the servers).
    metric_shapes: as for `make_train_function`.
  """
  shapes = sum_shapes(EVAL_KEYS, metric_shapes)

  def one_batch(batch):
    if not replicated:
      return step(*batch)
    if split_on_host:
      batch = feeds.split_batch(strategy, batch)
    return _reduce_sum(strategy, strategy.run(step, args=batch))

  def evaluate(dataset):
    totals = _zeros(shapes)
    for batch in dataset:
      totals = _add(totals, one_batch(tuple(batch)))
    return totals

  return compiled(evaluate)


def make_resident_eval_function(strategy: tf.distribute.Strategy, step: StepFn,
                                *, metric_shapes: Shapes | None = None
                                ) -> Callable[..., dict[str, tf.Tensor]]:
  """Returns `evaluate(batches, num_steps) -> summed results`, for data held
  on the devices (`resident.EpochBatches.from_step(0)`): each replica
  gathers its rows on its own device, sums in replica-local variables, and
  the sums are reduced once at the end, as in training.

  Args:
    strategy: a strategy for which `resident.supports` holds.
    step: per-replica `step(x, y, mask[, sample_weight]) -> dict`.
    metric_shapes: as for `make_train_function`.
  """
  sums = _ReplicaSums(strategy, sum_shapes(EVAL_KEYS, metric_shapes))

  def replica_step(data, index, i):
    sums.add(step(*resident.gather_batch(data, index, i)))

  def evaluate(batches, num_steps):
    data, index, first_step = batches
    strategy.run(sums.reset)
    for i in tf.range(num_steps):
      strategy.run(replica_step, args=(data, index, first_step + i))
    return sums.read()

  # Each input size is a new shape.
  return compiled(evaluate, reduce_retracing=True)
