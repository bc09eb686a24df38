"""`execution`: which runner a Trainer's steps take."""

import keras
import pytest
import tensorflow as tf

from tfmgpu.training import coordinator
from tfmgpu.training import execution


def test_a_parameter_server_strategy_is_sent_to_its_trainer():
  """`Trainer(model, strategy=<ParameterServerStrategy>)` failed at the
  first step with TF's "use this dataset in
  ClusterCoordinator.create_per_worker_dataset"."""
  cls = tf.distribute.experimental.ParameterServerStrategy
  strategy = cls.__new__(cls)  # A cluster is not needed to be refused.
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  with pytest.raises(ValueError, match=(
      r"strategy=ParameterServerStrategy needs tfmgpu\.ParameterServerTrainer"
      r"\(model, strategy=strategy, \.\.\.\)")):
    execution.SyncExecution(strategy, model, None, None)


def test_the_coordinators_execution_takes_it():
  assert coordinator.CoordinatorExecution.coordinated
  assert not execution.SyncExecution.coordinated
