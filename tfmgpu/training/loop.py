"""The trainer: a Keras model, its optimizer and strategy, and `fit`.

The outermost of the three layers, as an object a user holds. `Trainer`
owns the optimizer (built in the strategy's scope before the first step,
which Keras 3 needs inside a distributed `tf.function`) and the step
(`tfmgpu.training.step`); its execution (`tfmgpu.training.execution`,
chosen once) plans the input (`tfmgpu.training.feeds`), compiles the step
into a distributed function, wraps it in a runner and evaluates
(`tfmgpu.training.evaluation`); the `Controller`
(`tfmgpu.training.controller`) runs the epochs. Its settings are one
`TrainerOptions` (`tfmgpu.training.trainer_options`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import checks
from tfmgpu import rundir
from tfmgpu.strategies import collective_keys
from tfmgpu.training import allreduce as allreduce_lib
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import coordinator
from tfmgpu.training import execution as execution_lib
from tfmgpu.training import inputs
from tfmgpu.training import keras_names
from tfmgpu.training import model_checks
from tfmgpu.training import objectives
from tfmgpu.training import optimizers
from tfmgpu.training import preemption as preemption_lib
from tfmgpu.training import resident
from tfmgpu.training import step as step_lib
from tfmgpu.training import workers
from tfmgpu.training.controller import Controller
from tfmgpu.training.controller import LoopOptions
from tfmgpu.training.controller import NonFiniteLossError  # pylint: disable=unused-import  (public here)
from tfmgpu.training.controller import TrainResult
from tfmgpu.training.optimizers import prepare_optimizer
from tfmgpu.training.optimizers import OPTIMIZER_CHOICES  # pylint: disable=unused-import  (public here)
from tfmgpu.training.trainer_options import TrainerOptions
from tfmgpu.parallel.zero_placement import shard_for_trainer


# Executions by name: a registered distribution names its own
# (`Distribution.execution`).
EXECUTIONS: dict[str, type[execution_lib.SyncExecution]] = {
    "sync": execution_lib.SyncExecution,
    "coordinator": coordinator.CoordinatorExecution,
}


@keras_names.explain_keras_names  # fit(batch_size=...) says global_batch_size.
class Trainer:
  """Trains a Keras model with `strategy.run` steps, on any strategy: a thin
  front over one `TrainerOptions`, an execution's runner and evaluator
  (`tfmgpu.training.execution`) and a `Controller` for the epochs. Example:

    strategy = tfmgpu.get_strategy("mirrored")
    with strategy.scope():
      model = tfmgpu.build_model("convnet", input_shape=(28, 28, 1),
                                 num_classes=10)
    trainer = tfmgpu.Trainer(model, strategy=strategy, learning_rate=1e-3)
    result = trainer.fit(x, y, epochs=2, global_batch_size=64)

  Args:
    model: a Keras model built in `strategy.scope()`; a staged or pipelined
      model brings its own per-device backward. With `zero_stage=1|2|3`
      it is sharded over the strategy's devices (`zero_placement`).
    strategy: a `tf.distribute.Strategy` or name; defaults to the current.
    options: a `TrainerOptions` (optimizer, loss, metrics, input mode,
      model_dir, callbacks, ...). Defaults to `TrainerOptions()`.
    execution: how steps run: `"sync"` (`strategy.run`) or `"coordinator"`
      (parameter servers: `ParameterServerTrainer`). Defaults to `"sync"`.
    **settings: `TrainerOptions` fields, applied over `options`; a compiled
      model's optimizer, loss and metrics fill what neither sets.
  """

  def __init__(self, model: keras.Model, *,
               strategy: tf.distribute.Strategy | str | None = None,
               options: TrainerOptions | None = None,
               execution: str = "sync", **settings: Any):
    settings = model_checks.compiled_settings(model, options, settings)
    self.options = o = TrainerOptions.of(options, settings)
    strategy = model_checks.strategy_named(model, strategy, o.zero_stage)
    model, strategy = shard_for_trainer(model, strategy, o.zero_stage)
    self.model = model
    self.strategy = strategy or tf.distribute.get_strategy()
    collective_keys.share(self.strategy)  # Before anything is traced.
    self.objective = objectives.Objective(model, o.loss, o.metrics,
                                          o.loss_weights, o.weighted_metrics)
    resident.check_input_mode(o.input_mode, self.strategy)
    model_checks.check_model(model, self.strategy, o)
    checks.check_choice("execution", execution, EXECUTIONS)
    # tfmgpu sums replica gradients (then clips) unless TF does (PS).
    owns_allreduce = EXECUTIONS[execution].owns_allreduce
    self.optimizer = prepare_optimizer(
        o.optimizer, model, self.strategy, learning_rate=o.learning_rate,
        clip_norm=None if owns_allreduce else o.clip_norm,
        fused=o.fused_optimizer)
    self.allreduce = allreduce_lib.take_over_aggregation(
        self.optimizer, allreduce_lib.AllReduceOptions(
            compression=o.gradient_compression,
            bytes_per_pack=o.bytes_per_pack, clip_norm=o.clip_norm)
    ) if owns_allreduce else None
    self.execution = EXECUTIONS[execution](self.strategy, model,
                                           self.objective, o)
    self.evaluator = self.execution.evaluator()
    self._train_fns: dict[tuple[int | None, str], Any] = {}
    self._trainable = model_checks.TrainableWeights(model)
    self._checkpointer: ckpt_lib.Checkpointer | None = None
    self._writer, self._any_worker = None, workers.AnyWorker(self.strategy)

  @property
  def num_replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

  @property
  def model_dir(self) -> str | None:
    return self.options.model_dir

  @property
  def checkpointer(self) -> ckpt_lib.Checkpointer | None:
    """The run's checkpoints (`None` without a `model_dir`)."""
    if self.model_dir and self._checkpointer is None:
      self._checkpointer = ckpt_lib.Checkpointer(
          self.model_dir, self.strategy, model=self.model,
          optimizer=self.optimizer)
    return self._checkpointer

  def evaluate(self, x: Any, y: Any = None, *, sample_weight: Any = None,
               global_batch_size: int = 256) -> dict[str, float]:
    """The loss and metrics over every example of the input (no row dropped).

    Args:
      x, y, sample_weight: as for `fit` (arrays, a dataset or a dataset
        function); arrays are batched by `global_batch_size`, their last
        batch padded and masked out.
      global_batch_size: examples per evaluation step over all replicas.

    Returns:
      `{"loss": mean loss, <metric>: value, ..., "count": rows}`.
    """
    return self.evaluator.evaluate(inputs.from_user(x, y, sample_weight),
                                   global_batch_size)

  def fit(self, x: Any, y: Any = None, *, sample_weight: Any = None,
          epochs: int = 1, global_batch_size: int | None = None,
          steps_per_epoch: int | None = None, validation_data: Any = None,
          seed: int = 0, shuffle: bool = True, class_weight: Any = None) -> TrainResult:
    """Trains for `epochs` (resuming from `model_dir` if it has checkpoints).

    Inputs follow Keras (`tfmgpu.training.inputs`): in-memory arrays (any
    nesting of dicts, lists and tuples), batched here; a `tf.data.Dataset`
    of `(x, y[, sample_weight])` global batches, batched by you; or a
    dataset function `fn(input_context)` batching per replica.

    Args:
      x: inputs: arrays, a `tf.data.Dataset` or a dataset function.
      y: targets (arrays only; a dataset carries its own).
      sample_weight, class_weight: per-example weights (arrays only); Keras' {class: weight}.
      epochs: total epochs; a resumed run trains only the missing ones.
      global_batch_size: examples per step over all replicas, for arrays
        (default 64); must divide by the replica count. A dataset sets its
        own batch.
      steps_per_epoch: steps per epoch. Defaults to one pass over the data
        (`len(x) // global_batch_size`, or the dataset's length); needed for
        an infinite dataset or one whose length TF does not know.
      validation_data: `(x_val, y_val[, sample_weight])`, a dataset or a
        dataset function, evaluated after each epoch (`val_` logs).
      seed: fixes every epoch's shuffle order of arrays (`inputs.epoch_order`).
      shuffle: shuffle arrays each epoch (a dataset shuffles itself).

    Returns:
      A `TrainResult`.

    Raises:
      ValueError, TypeError: bad inputs or sizes (indivisible batch, too few
        examples, unknown length without `steps_per_epoch`), a checkpoint
        beyond `steps_per_epoch`, `layer.trainable` changed since made, or
        workers given different settings (`workers.WorkersDisagreeError`).
      NonFiniteLossError: the loss became NaN/inf (the step named, the last
        good checkpoint kept).
      tfmgpu.training.checkpoints.PreemptedError: SIGTERM (with a `model_dir`):
        every worker saved at the same step; `fit` in a new process resumes.
    """
    self._trainable.check_unchanged()
    plan = self.execution.plan(
        inputs.from_fit(x, y, sample_weight, class_weight), epochs=epochs,
        global_batch_size=global_batch_size, steps_per_epoch=steps_per_epoch)
    workers.require_same_run(self._any_worker, workers.fit_settings(
        self, plan, epochs=epochs, seed=seed, shuffle=shuffle, validation=validation_data))
    runner = self.execution.runner(
        self._train_fn(plan.global_batch_size, plan.feed), plan, seed=seed,
        shuffle=shuffle)
    # The lock before the summary writer opens its file.
    with self._hold_run_dir(), optimizers.optimizer_on_model(self.model, self.optimizer):
      controller = Controller(runner, self._loop_options(
          plan.global_batch_size, validation_data))
      try:
        with self._watch_preemption() as watcher:
          return controller.run(epochs=epochs,
                                steps_per_epoch=plan.steps_per_epoch,
                                watcher=watcher)
      finally:
        self.evaluator.release()  # Validation data held for this fit only.

  def close(self) -> None:
    """Flushes summaries; removes a non-chief's temporary files now."""
    if self._writer is not None:
      self._writer.close()
    if self._checkpointer is not None:
      self._checkpointer.close()

  def _train_fn(self, global_batch_size: int | None, feed: str):
    key = (global_batch_size, feed)
    if key not in self._train_fns:
      step = step_lib.make_train_step(
          self.model, self.optimizer, global_batch_size=global_batch_size,
          loss=self.objective, jit_compile=self.options.jit_compile,
          batch_splits=self.options.batch_splits, allreduce=self.allreduce)
      self._train_fns[key] = self.execution.train_function(step, feed)
    return self._train_fns[key]

  def _loop_options(self, global_batch_size: int | None, validation_data
                    ) -> LoopOptions:
    o = self.options
    writes = bool(o.model_dir) and ckpt_lib.is_chief(self.strategy)
    if self._writer is None:  # A no-op one off the chief.
      self._writer = (tf.summary.create_file_writer(
          os.path.join(o.model_dir, "summaries")) if writes
                      else tf.summary.create_noop_writer())
    return LoopOptions(
        model=self.model, optimizer=self.optimizer,
        global_batch_size=global_batch_size, callbacks=list(o.callbacks),
        verbose=o.verbose, checkpointer=self.checkpointer,
        summary_writer=self._writer, writes_summaries=writes,
        validate=self.evaluator.validation(validation_data, global_batch_size),
        metric_results=self.objective.results, metric_names=self.objective.metric_names,
        checkpoint_every_steps=o.checkpoint_every_steps,
        checkpoint_every_s=o.checkpoint_every_s, any_worker=self._any_worker)

  def _hold_run_dir(self):
    """The chief's lock of the run directory (`tfmgpu.rundir`; reentrant)."""
    chief = self.model_dir and ckpt_lib.is_chief(self.strategy)
    return rundir.RunLock(self.model_dir) if chief else contextlib.nullcontext()

  def _watch_preemption(self):
    """SIGTERM becomes a checkpoint when the run keeps checkpoints."""
    return (preemption_lib.PreemptionWatcher(self.strategy) if self.model_dir
            else contextlib.nullcontext())
