"""Parameter-server execution: the coordinator schedules steps on the workers.

`ParameterServerStrategy`, which Keras 3 `model.fit` does not support,
trains from the coordinator (the "chief" task); the "ps" tasks hold the
variables and the "worker" tasks only run servers
(`tfmgpu.cluster.run_server`). `CoordinatorExecution` is the runner and
evaluator pair a `Trainer` uses there (`execution="coordinator"`, chosen by
the `parameter_server` distribution). Each epoch the coordinator schedules
`steps_per_epoch` steps with `ClusterCoordinator.schedule` (in functions of
`steps_per_execution` steps) and joins them in chunks, so a SIGTERM to the
coordinator saves a checkpoint within a chunk (`CoordinatorRunner`).
Evaluation runs on the coordinator, reading the variables from the
parameter servers (`CoordinatorEvaluator`).

Training is asynchronous: each worker applies its own gradients to the
variables as soon as it has them, so which worker runs which step (and so
the exact model) changes from run to run; step counts and checkpoints are
exact (they are taken after a join). Each worker reads the whole training set
repeatedly, in its own shuffled order: TensorFlow gives a per-worker dataset
function no worker index to shard by, so the shuffle is seeded from each
worker's clock.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.training import distributed
from tfmgpu.training import evaluation
from tfmgpu.training import execution
from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training import step as step_lib
from tfmgpu.training.controller import StepSums
from tfmgpu.training.runners import to_sums

# Scheduled functions per worker between two joins: bounds how long a SIGTERM
# waits for a checkpoint, at the cost of an idle moment per join.
CALLS_PER_WORKER_PER_JOIN = 4


class CoordinatorRunner:
  """Schedules steps on the workers and joins them in chunks.

  One `run` schedules up to `calls_per_join` functions of
  `steps_per_execution` steps, waits for all of them (so step counts and
  checkpoints are exact) and returns their sums. A `run` of fewer steps
  than one call per worker (the controller stops a join at a periodic
  checkpoint) splits them into shorter calls, one per worker, so that no
  worker idles through the join.
  """

  coordinator_only = True  # Only the coordinator catches SIGTERM.

  def __init__(self, coordinator, train_fn, iterator, *,
               steps_per_execution: int, calls_per_join: int,
               workers: int = 1):
    self.coordinator = coordinator
    self.train_fn = train_fn
    self.iterator = iterator
    self.steps_per_execution = steps_per_execution
    self.calls_per_join = calls_per_join
    self.workers = max(workers, 1)

  def start_epoch(self, epoch: int, first_step: int) -> None:
    del epoch, first_step  # Workers read endless streams of their own.

  def run(self, done: int, limit: int) -> StepSums:
    del done
    scheduled, results = 0, []
    per_call = min(self.steps_per_execution, -(-limit // self.workers))
    while len(results) < self.calls_per_join and scheduled < limit:
      n = min(per_call, limit - scheduled)
      results.append((n, self.coordinator.schedule(
          self.train_fn, args=(self.iterator, tf.constant(n)))))
      scheduled += n
    self.coordinator.join()
    total = StepSums(steps=0, loss=0.0, count=0.0)
    for n, r in results:
      total = total + to_sums(r.fetch(), n)
    return total


class CoordinatorEvaluator(evaluation.Evaluator):
  """Evaluation on the coordinator, each batch of a plain dataset run right
  there, reading the variables from the servers."""

  def make_function(self, split_on_host: bool) -> Callable[..., Any]:
    del split_on_host  # Never: the coordinator runs each batch itself.
    return distributed.make_eval_function(
        self.strategy, step_lib.make_eval_step(self.model,
                                               loss=self.objective),
        replicated=False, metric_shapes=self.objective.state_shapes())

  def dataset(self, source: inputs.InputData, global_batch_size: int,
              split_on_host: bool) -> Any:
    del split_on_host  # The coordinator reads plain datasets.
    if isinstance(source, inputs.DatasetData):
      return inputs.with_mask(source.dataset)
    if isinstance(source, inputs.DatasetFnData):
      return inputs.with_mask(source.fn(tf.distribute.InputContext()))
    return tf.data.Dataset.from_tensor_slices(source.padded(1)).batch(
        global_batch_size)


class CoordinatorExecution(execution.SyncExecution):
  """Steps scheduled by a `ClusterCoordinator`; workers stream endlessly,
  and gradients go to the variables' servers (the strategy's)."""
  owns_allreduce = False
  streams = True
  coordinated = True

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
        self.strategy)
    self.num_workers = _compat.parameter_server_workers(self.strategy)
    # Variables split over the servers (`variable_shards`) checkpoint and
    # save as whole ones: the parts joined.
    _compat.make_shards_whole(self.model.variables)

  def train_function(self, step: Callable[..., Any], feed: str
                     ) -> Callable[..., Any]:
    """Sums local to each scheduled call (workers run calls concurrently)."""
    del feed  # Workers read their own tf.data streams.
    return distributed.make_scheduled_train_function(
        self.strategy, step,
        check_fn=lambda: step_lib.non_finite_weights(self.model),
        metric_shapes=self.objective.state_shapes())

  def runner(self, train_fn: Callable[..., Any], plan: feeds.InputPlan, *,
             seed: int, shuffle: bool) -> CoordinatorRunner:
    """`seed` is unused: each worker shuffles in its own order (see the
    module docstring). Each step trains on one global batch on one
    worker."""
    del seed
    return CoordinatorRunner(
        self.coordinator, train_fn,
        self._per_worker_iterator(plan.source, plan.global_batch_size,
                                  shuffle),
        steps_per_execution=self.options.steps_per_execution,
        calls_per_join=CALLS_PER_WORKER_PER_JOIN * self.num_workers,
        workers=self.num_workers)

  def evaluator(self) -> CoordinatorEvaluator:
    return CoordinatorEvaluator(self.strategy, self.model, self.objective,
                                input_mode=self.options.input_mode)

  def _per_worker_iterator(self, source: inputs.InputData,
                           global_batch_size: int | None, shuffle: bool):
    """An iterator on each worker over its own endless stream: arrays
    shuffled per worker, or the user's dataset function, repeated."""
    if isinstance(source, inputs.DatasetFnData):
      dataset_fn = lambda ctx: source.fn(ctx).repeat()  # pylint: disable=unnecessary-lambda-assignment
    else:
      dataset_fn = _endless_arrays(source.data, global_batch_size, shuffle)

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    return iter(self.coordinator.create_per_worker_dataset(
        per_worker_dataset_fn))


def _endless_arrays(data: tuple, global_batch_size: int, shuffle: bool):
  """A dataset function streaming `data`'s rows, reshuffled each pass."""

  def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    tensors = tf.nest.map_structure(tf.constant, data)
    n = len(tf.nest.flatten(data)[0])
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
        lambda i: tf.nest.map_structure(lambda t: tf.gather(t, i), tensors))
    ds = ds.batch(ctx.get_per_replica_batch_size(global_batch_size),
                  drop_remainder=True)
    return ds.prefetch(tf.data.AUTOTUNE)

  return dataset_fn
