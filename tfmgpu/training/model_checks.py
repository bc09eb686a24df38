"""Checks of the model a `Trainer` is given, before its first step."""

from __future__ import annotations

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import strategies as strategies_lib
from tfmgpu.training import step as step_lib


def check_built_in_scope(model: keras.Model,
                         strategy: tf.distribute.Strategy) -> None:
  """Raises a clear `ValueError` for a model without variables, or built
  outside the scope of a strategy with several replicas."""
  if not model.trainable_variables:
    raise ValueError(
        f"model {model.name!r} has no trainable variables: build it before "
        "training. Give it a keras.Input, or call it once on a batch inside "
        "the strategy's scope (`with strategy.scope(): model(x[:1])`; "
        "`model.build(shape)` does not create the variables of a subclassed "
        "model without a build() method).")
  if (strategy.num_replicas_in_sync == 1
      and not strategies_lib.in_multi_worker_mode(strategy)):
    return
  v = model.trainable_variables[0]
  if not strategy.extended.variable_created_in_scope(getattr(v, "value", v)):
    raise ValueError(
        f"model {model.name!r} was not built in the scope of the strategy "
        f"({type(strategy).__name__}, {strategy.num_replicas_in_sync} "
        "replicas): its variables would not be mirrored. Build it under "
        "`with strategy.scope():` (tfmgpu.build_model does this for you).")


def warn_about_custom_steps(model: keras.Model) -> None:
  """Logs a warning when the model overrides a step the Trainer never
  calls (`train_step`, `test_step`, `compute_loss`)."""
  if step_lib.brings_own_backward(model):
    return  # A placed model: the Trainer runs its per-device backward.
  custom = [name for name in ("train_step", "test_step", "compute_loss")
            if getattr(type(model), name, None) is not getattr(keras.Model,
                                                               name)]
  if custom:
    logging.warning(
        "Model %r overrides %s: tfmgpu's Trainer runs its own step (forward, "
        "Trainer(loss=...), gradients, all-reduce, update) and does not call "
        "it. Put extra loss terms in call() with self.add_loss(...), or train "
        "with model.fit under strategy.scope() to use your own step.",
        model.name, ", ".join(custom))
