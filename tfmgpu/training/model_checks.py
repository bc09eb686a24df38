"""Checks of the model a `Trainer` is given, before its first step."""

from __future__ import annotations

from typing import Any

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


# What a `Trainer` takes from the model's own `compile()` when not given.
_FROM_COMPILE = ("optimizer", "loss", "loss_weights", "metrics",
                 "weighted_metrics")


def _compiled_value(model: keras.Model, name: str) -> Any:
  """The model's compiled `name`: the optimizer (unbuilt: a built one is
  copied from its config, its slots fresh), the loss, or what the compile
  config holds (metrics only by name)."""
  if name == "optimizer":
    optimizer = model.optimizer
    if optimizer is not None and optimizer.built:
      return type(optimizer).from_config(optimizer.get_config())
    return optimizer
  if name == "loss":
    return model.loss
  value = (model.get_compile_config() or {}).get(name)
  if name.endswith("metrics") and value is not None and not all(
      isinstance(m, str) for m in tf.nest.flatten(value)):
    logging.warning(
        "Model %r was compiled with %s objects, which the Trainer cannot "
        "take from it: pass Trainer(%s=...) to report them.", model.name,
        name, name)
    return None
  return value


def compiled_settings(model: keras.Model, options: Any,
                      settings: dict[str, Any]) -> dict[str, Any]:
  """`settings` (the `Trainer`'s keyword arguments) completed with what
  the model's own `compile()` set, for each of optimizer, loss, loss
  weights and metrics not given, and logged: a compiled model trains as its
  `fit` would (it trained with the Trainer's defaults, silently). Nothing
  is taken when `options` are given."""
  if options is not None or not getattr(model, "compiled", False):
    return settings
  taken = {name: _compiled_value(model, name) for name in _FROM_COMPILE
           if name not in settings}
  taken = {k: v for k, v in taken.items() if v is not None}
  if taken:
    logging.info("Model %r was compiled: the Trainer takes its %s (pass "
                 "them to Trainer(...) to override).", model.name,
                 ", ".join(taken))
  return {**settings, **taken}

