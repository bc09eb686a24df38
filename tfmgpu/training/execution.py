"""How a Trainer's steps run: the runner and evaluator of one kind of strategy.

An `Execution` is chosen once, by name, when a `Trainer` is made (a
registered distribution names its own: `Distribution.execution`). It plans
each `fit`'s input (`tfmgpu.training.feeds.plan_input`), compiles the step
into a distributed function, wraps that in the runner the `Controller`
drives, and makes the `Evaluator`. `SyncExecution` runs synchronous
`strategy.run` steps on any strategy but parameter servers, whose
coordinator schedules them (`tfmgpu.training.coordinator`).
"""

from __future__ import annotations

from typing import Any, Callable

from absl import logging
import keras
import tensorflow as tf

from tfmgpu.training import distributed
from tfmgpu.training import evaluation
from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training import objectives
from tfmgpu.training import runners
from tfmgpu.training import step as step_lib
from tfmgpu.training import string_inputs
from tfmgpu.training.controller import StepRunner
from tfmgpu.training.trainer_options import TrainerOptions


class SyncExecution:
  """Synchronous steps under `strategy.run` (`runners.SyncRunner`).

  Attributes:
    owns_allreduce: tfmgpu sums the replicas' gradients itself (and clips
      the sum); `False` leaves the gradients to the strategy.
    streams: each worker streams the input on its own (see
      `feeds.plan_input`).
    coordinated: a coordinator schedules the steps (parameter servers).
  """
  owns_allreduce = True
  streams = False
  coordinated = False

  def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model,
               objective: objectives.Objective, options: TrainerOptions):
    if not self.coordinated and isinstance(
        strategy, tf.distribute.experimental.ParameterServerStrategy):
      # Its steps are scheduled by a coordinator: TF failed at the first
      # step ("use this dataset in ClusterCoordinator.create_per_worker_
      # dataset"), which names neither the cause nor tfmgpu's fix.
      raise ValueError(
          "strategy=ParameterServerStrategy needs "
          "tfmgpu.ParameterServerTrainer(model, strategy=strategy, ...), "
          "which schedules the steps on the workers from the coordinator; "
          "Trainer runs synchronous steps under every other strategy. Make "
          "the trainer with tfmgpu.ParameterServerTrainer instead.")
    self.strategy = strategy
    self.model = model
    self.objective = objective
    self.options = options

  def plan(self, source: inputs.InputData, *, epochs: int,
           global_batch_size: int | None,
           steps_per_epoch: int | None) -> feeds.InputPlan:
    """The checked sizes and the feed of one `fit` (strings the model
    does not take refused first)."""
    string_inputs.check_source(self.model, source)
    return feeds.plan_input(
        source, self.strategy, input_mode=self.options.input_mode,
        epochs=epochs, global_batch_size=global_batch_size,
        steps_per_epoch=steps_per_epoch, streams=self.streams)

  def train_function(self, step: Callable[..., Any], feed: str
                     ) -> Callable[..., Any]:
    """The distributed function that runs `step` several times per call."""
    return distributed.make_train_function(
        self.strategy, step,
        check_fn=lambda: step_lib.non_finite_weights(self.model),
        feed=feed, metric_shapes=self.objective.state_shapes())

  def runner(self, train_fn: Callable[..., Any], plan: feeds.InputPlan, *,
             seed: int, shuffle: bool) -> StepRunner:
    """What the `Controller` drives for `plan`."""
    logging.info("Training data: %s.", plan.describe())
    left_out = plan.rows_left_out(shuffle)
    if left_out:
      (logging.info if shuffle else logging.warning)("%s", left_out)
    return runners.SyncRunner(
        train_fn, self.strategy, plan.source,
        global_batch_size=plan.global_batch_size,
        steps_per_execution=self.options.steps_per_execution, seed=seed,
        shuffle=shuffle, steps_per_epoch=plan.steps_per_epoch, feed=plan.feed)

  def evaluator(self) -> evaluation.Evaluator:
    """The evaluation runner of `Trainer.evaluate` and validation."""
    return evaluation.Evaluator(self.strategy, self.model, self.objective,
                                input_mode=self.options.input_mode)
