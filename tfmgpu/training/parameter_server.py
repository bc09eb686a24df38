"""Parameter-server training from the coordinator: `ParameterServerTrainer`.

A `Trainer` whose steps the coordinator schedules on the workers
(`execution="coordinator"`: `tfmgpu.training.coordinator`, where the runner,
the evaluator and the notes on asynchronous training live). Runs in the
"chief" task; the "ps" tasks hold the variables and the "worker" tasks only
run servers (`tfmgpu.cluster.run_server`).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfmgpu.training.coordinator import CALLS_PER_WORKER_PER_JOIN  # pylint: disable=unused-import  (public here)
from tfmgpu.training.coordinator import CoordinatorRunner  # pylint: disable=unused-import  (public here)
from tfmgpu.training.loop import Trainer
from tfmgpu.training.loop import TrainResult  # pylint: disable=unused-import  (public here)


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` is a `ParameterServerStrategy` (needs this trainer)."""
  return isinstance(strategy,
                    tf.distribute.experimental.ParameterServerStrategy)


class ParameterServerTrainer(Trainer):
  """Trains a Keras model on a parameter-server cluster, from the coordinator.

  Takes the arguments of `Trainer`; `strategy` must be a
  `ParameterServerStrategy` (`tfmgpu.get_strategy("parameter_server")`) and
  the model must be built in its scope. Keras callbacks get the train and
  epoch hooks, and a batch hook after each join.

  Example (in the "chief" task of a cluster with "ps" and "worker" jobs):
    strategy = tfmgpu.get_strategy("parameter_server")
    with strategy.scope():
      model = tfmgpu.models.build_model("convnet", input_shape=(28, 28, 1),
                                        num_classes=10)
    trainer = ParameterServerTrainer(model, strategy=strategy)
    trainer.fit(x, y, epochs=3, global_batch_size=64)
    print(trainer.evaluate(x_test, y_test))

  Raises:
    ValueError: `strategy` is not a `ParameterServerStrategy`.
  """

  def __init__(self, model: keras.Model, *, strategy: tf.distribute.Strategy,
               **kwargs: Any):
    if not is_parameter_server(strategy):
      raise ValueError(
          f"ParameterServerTrainer needs a ParameterServerStrategy; got "
          f"strategy={type(strategy).__name__}. Use tfmgpu.get_strategy("
          "'parameter_server') in the chief task, or Trainer for other "
          "strategies.")
    super().__init__(model, strategy=strategy, execution="coordinator",
                     **kwargs)
    self.coordinator = self.execution.coordinator  # As before: public.
    self.num_workers = self.execution.num_workers
