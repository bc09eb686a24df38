"""Checks of the model a `Trainer` is given, before its first step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu import strategies as strategies_lib
from tfmgpu.parallel import layout_maps
from tfmgpu.parallel import placed_model
from tfmgpu.training import batch_splits as batch_splits_lib
from tfmgpu.training import fused as fused_lib
from tfmgpu.training import optimizers as optimizers_lib
from tfmgpu.training import step as step_lib


def check_model(model: keras.Model, strategy: tf.distribute.Strategy,
                options: Any) -> None:
  """The checks of a `Trainer`'s model before its first step: built in
  the strategy's scope, custom steps it will not call (refused),
  stateful RNNs only on one device, and `options.batch_splits` it can
  train with; a global Keras distribution, which it ignores, said (a
  warning)."""
  layout_maps.warn_if_keras_distribution("tfmgpu's Trainer")
  refuse_stateful_replicas(model, strategy)
  say_replica_norms(model, strategy)
  check_built_in_scope(model, strategy)
  refuse_custom_steps(model, options.loss)
  batch_splits_lib.check(model, options.batch_splits)


class TrainableWeights:
  """The model's trainable weights when a `Trainer` was made: its step and
  optimizer are made for them (Keras' `compile` likewise)."""

  def __init__(self, model: keras.Model):
    self.model = model
    self.paths = {id(v): v.path for v in model.trainable_variables}
    check = getattr(model, "check_source_unchanged", None)
    if check is not None:  # A split model: its source's flags since.
      check()

  def check_unchanged(self) -> None:
    """Raises when `layer.trainable` changed since (the keras.io
    fine-tuning workflow unfreezes a base between two fits): the old step
    would go on training the old weights, ignoring the change silently.

    Raises:
      ValueError: naming weights that changed and what to do.
    """
    now = {id(v): v.path for v in self.model.trainable_variables}
    if now.keys() == self.paths.keys():
      return
    added = [p for i, p in now.items() if i not in self.paths]
    removed = [p for i, p in self.paths.items() if i not in now]
    said = [f"{len(items)} {what} ({', '.join(items[:3])}"
            f"{', ...' if len(items) > 3 else ''})"
            for items, what in ((added, "now trainable"),
                                (removed, "now frozen")) if items]
    raise ValueError(
        f"model {self.model.name!r}'s trainable weights changed since this "
        f"Trainer was made: {'; '.join(said)}. Its step and optimizer were "
        "made for the old ones and would train them as before. Make a new "
        "Trainer(model, ...) after changing layer.trainable (as Keras needs "
        "model.compile() again; its optimizer starts fresh, as a recompiled "
        "one does).")


def strategy_named(model: keras.Model, strategy: Any,
                   zero_stage: int = 0) -> Any:
  """`strategy`, or for a registered name (`"mirrored"`) a new strategy
  from `tfmgpu.get_strategy`.

  Raises:
    ValueError: a name, with a model whose weights were made outside the
      new strategy's scope (they would not be mirrored; the Trainer does
      not train a copy: the model given is the one trained), unless ZeRO
      shards it (`zero_stage`: it takes a model made outside).
  """
  if strategy is None:  # The one the model was built in, as Keras' fit.
    return _built_in(model)
  if not isinstance(strategy, str):
    return strategy
  made = strategies_lib.get_strategy(strategy)
  if zero_stage:
    return made
  try:
    check_built_in_scope(model, made)
  except ValueError as e:
    if not model.trainable_variables:
      raise
    raise ValueError(
        f"strategy={strategy!r} makes a new strategy, and model "
        f"{model.name!r} was built outside its scope: its variables would "
        "not be mirrored. Make the strategy first and build the model in it: "
        f"`strategy = tfmgpu.get_strategy({strategy!r})`, then `with "
        "strategy.scope(): model = ...`, then `Trainer(model, "
        "strategy=strategy)`.") from e
  return made


def _built_in(model: keras.Model) -> Any:
  """The strategy whose scope made `model`'s weights (its variables'),
  `None` (the current one) for plain variables: a model built in a
  mirrored scope and given no `strategy=` failed deep in the fused update
  ("tuple indices must be integers or slices, not MirroredVariable")."""
  for v in model.trainable_variables:
    found = getattr(getattr(v, "value", v), "distribute_strategy", None)
    if found is not None:
      return found
  return None


def check_built_in_scope(model: keras.Model,
                         strategy: tf.distribute.Strategy) -> None:
  """Raises a clear `ValueError` for a model without variables, or built
  outside the scope of a strategy with several replicas or one device of
  its own (TF's colocation error said only "`colocate_vars_with` must only
  be passed a variable created in this tf.distribute.Strategy.scope()")."""
  if not model.trainable_variables:
    raise ValueError(
        f"model {model.name!r} has no trainable variables: build it before "
        "training. Give it a keras.Input, or call it once on a batch inside "
        "the strategy's scope (`with strategy.scope(): model(x[:1])`; "
        "`model.build(shape)` does not create the variables of a subclassed "
        "model without a build() method).")
  if (strategy.num_replicas_in_sync == 1
      and not strategies_lib.in_multi_worker_mode(strategy)
      and not isinstance(strategy, tf.distribute.OneDeviceStrategy)):
    return  # TF's default strategy (and a one-worker, one-replica one).
  v = model.trainable_variables[0]
  if not strategy.extended.variable_created_in_scope(getattr(v, "value", v)):
    raise ValueError(
        f"model {model.name!r} was not built in the scope of the strategy "
        f"({type(strategy).__name__}, {strategy.num_replicas_in_sync} "
        "replicas): its variables would not be mirrored. Build it under "
        "`with strategy.scope():` (tfmgpu.build_model does this for you).")


def refuse_stateful_replicas(model: keras.Model,
                             strategy: tf.distribute.Strategy) -> None:
  """Refuses stateful RNN layers (`checks.refuse_stateful_layers`) under a
  strategy of several replicas, workers or parameter servers: each replica
  would run its own rows against the one state (placed models refuse them
  when they are made)."""
  replicas = strategy.num_replicas_in_sync
  if (replicas > 1 or strategies_lib.in_multi_worker_mode(strategy)
      or isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)):
    checks.refuse_stateful_layers(
        model, f"under {type(strategy).__name__} ({replicas} replicas)")


def say_replica_norms(model: keras.Model,
                      strategy: tf.distribute.Strategy) -> None:
  """Warns that training `BatchNormalization` layers normalise each
  replica's rows by their own statistics under a strategy of several
  replicas, as Keras' `fit` does there, so training differs from one
  device (a new user's trial: 1.1e-2 after one epoch, unsaid)."""
  replicas = strategy.num_replicas_in_sync
  names = checks.training_norms(model, synchronized=False) if replicas > 1 else []
  if replicas > 1:
    checks.say_random_draws(
        f"Model {model.name!r}", model, f"under {type(strategy).__name__} "
        f"on each of the {replicas} replicas from the same seeds (as Keras' "
        f"fit does there: row i and row i + B/{replicas} of a batch of B "
        "get the same draw)")
  if names:
    logging.warning(
        "BatchNormalization layers (%s) normalise each of the %d replicas' "
        "rows by their own statistics, as Keras' fit does under %s, so "
        "training differs from one device. BatchNormalization("
        "synchronized=True) normalises the global batch.",
        checks.shown_names(names), replicas, type(strategy).__name__)


def refuse_custom_steps(model: keras.Model, loss: Any = None) -> None:
  """Refuses a model that overrides a step the Trainer never calls
  (`train_step`, `test_step`, `compute_loss`): the Trainer runs its own
  step, so it would train (or evaluate) something other than the model's.

  A warning was not enough: a keras.io step computing MAE with an `mse`
  compiled trained MSE, its own tracker gone from the history (a new
  user's trial); with no loss at all, the default one (a VAE failed deep
  in TF).

  Raises:
    ValueError: naming the model, the steps, and the ways on.
  """
  if step_lib.brings_own_backward(model):
    return  # A placed model: the Trainer runs its per-device backward.
  custom = checks.overridden_steps(
      model, ("train_step", "test_step", "compute_loss"))
  if not custom:
    return
  name = (loss if isinstance(loss, str) else getattr(loss, "name", None)
          or getattr(loss, "__name__", type(loss).__name__))
  trains = (f"the loss you gave or compiled ({name})" if loss is not None
            else "the default loss (sparse categorical cross-entropy from "
            "logits)")
  try:  # A functional (or Sequential) model: a view can share its layers.
    functional = bool(model.inputs) and "compute_loss" not in custom
  except (AttributeError, ValueError):
    functional = False
  view = (" To train the same layers with the Trainer's step, pass "
          "Trainer(loss=...) and a plain functional view that shares their "
          "weights: keras.Model(model.inputs, model.outputs) (extra loss "
          "terms: self.add_loss(...) in a layer's call())." if functional
          else "")
  raise ValueError(
      f"model {model.name!r} ({type(model).__name__}) overrides "
      f"{', '.join(custom)}: tfmgpu's Trainer runs its own step (forward, "
      "loss, gradients, all-reduce, update) and would not call it, so it "
      f"would train {trains}, not what your step computes. To run your "
      "step, train with model.fit under "
      "tfmgpu.get_strategy('mirrored').scope(), where TF sums the "
      "replicas' gradients: divide a loss your step averages by hand by "
      f"self.distribute_strategy.num_replicas_in_sync.{view}")


# What a `Trainer` takes from the model's own `compile()` when not given.
_FROM_COMPILE = ("optimizer", "loss", "loss_weights", "metrics",
                 "weighted_metrics", "steps_per_execution")


def _compiled_value(model: keras.Model, name: str,
                    settings: dict[str, Any], own: bool = True) -> Any:
  """The model's compiled `name`: the optimizer (`_compiled_optimizer`),
  the loss, or what the compile config holds (metrics as new objects)."""
  if name == "optimizer":
    return (None if model.optimizer is None else
            _compiled_optimizer(model, settings, own))
  if name == "loss":
    return _plain(model.loss)
  value = (model.get_compile_config() or {}).get(name)
  if name == "steps_per_execution":  # Batch callbacks run once per call.
    return value if isinstance(value, int) and value > 1 else None
  if name.endswith("metrics") and value is not None:
    dropped: list[str] = []
    value = _rebuilt_metrics(_compat.compiled_metrics(model, name), value,
                             dropped)
    if dropped:
      logging.warning(
          "Model %r was compiled (by you, or by its class as it was built, "
          "as keras_hub's tasks are) with %s the Trainer cannot rebuild as "
          "they were, and does not report: %s. Give the class a get_config() "
          "returning every constructor argument, or pass Trainer(%s=[...]).",
          model.name, name, "; ".join(dropped), name)
  return value


def _plain(value: Any) -> Any:
  """A compiled per-output loss as a plain dict or list (Keras keeps it in
  TF's tracking proxies, which `typing.Mapping` / `typing.Sequence` do not
  recognise: tfmgpu checks with `collections.abc`'s)."""
  if isinstance(value, Mapping):
    return {k: value[k] for k in value}
  if isinstance(value, (list, tuple)):
    return list(value)
  return value


_DROPPED = object()


def _rebuilt_metrics(given: Any, config: Any, dropped: list[str]) -> Any:
  """The compiled metrics (`config`: the compile config's, per output in
  dicts or lists; `given`: the user's objects, in the same places) entry by
  entry: a metric object rebuilt from its config (the Trainer keeps its
  own state), a plain function the user's own (it holds none), a name as
  it is. One that does not rebuild as it was (its class cannot be found,
  or its config drops an argument: a `threshold` reported 0.17 for fit's
  1.0) is left out and named in `dropped`."""
  if isinstance(config, Mapping) and "class_name" not in config:
    given = given if isinstance(given, Mapping) else {}
    out = {k: _rebuilt_metrics(given.get(k), v, dropped)
           for k, v in config.items()}
    return {k: v for k, v in out.items() if v is not _DROPPED}
  if isinstance(config, (list, tuple)):
    if not (isinstance(given, (list, tuple)) and len(given) == len(config)):
      given = [None] * len(config)
    out = [_rebuilt_metrics(g, c, dropped) for g, c in zip(given, config)]
    return [m for m in out if m is not _DROPPED]
  if callable(given) and not isinstance(given, keras.metrics.Metric):
    return given
  if isinstance(config, str) or config is None:
    return config
  try:
    fresh = keras.metrics.deserialize(config)
  except (TypeError, ValueError) as e:
    dropped.append(f"{config.get('class_name', config)} ({e})")
    return _DROPPED
  lost = (checks.lost_arguments(given, fresh)
          if isinstance(given, keras.metrics.Metric) else [])
  if lost:
    dropped.append(f"{given.name!r} ({type(given).__name__}: its config "
                   f"drops {', '.join(lost)})")
    return _DROPPED
  return fresh


def _compiled_optimizer(model: keras.Model, settings: dict[str, Any],
                        own: bool = True) -> Any:
  """A copy of `model.optimizer` (its slots fresh; the Trainer adapts the
  one it trains to its strategy, and the model's own stays as it was) at
  the `learning_rate` given, fused with `fused_optimizer=True`. An unbuilt
  one that does not copy exactly is trained itself, with a warning,
  unless it is another model's (`own=False`: the model a split was made
  from keeps its optimizer).

  Raises:
    ValueError: a `learning_rate` it cannot take, or one that must be
      copied (built, or a learning rate to set) and does not copy exactly.
  """
  optimizer, rate = model.optimizer, settings.get("learning_rate")
  try:
    copy = optimizers_lib.copy_of(optimizer)
  except ValueError as e:
    if optimizer.built or rate is not None or not own:
      why = ("its slots exist" if optimizer.built else
             "to set learning_rate=" if rate is not None else
             "it belongs to the model a split was made from")
      raise ValueError(
          f"Model {model.name!r} was compiled with "
          f"{type(optimizer).__name__}(...), which the Trainer must copy "
          f"({why}), but {e}. Pass Trainer(optimizer=...) by name, e.g. "
          "optimizer='adam'.") from e
    logging.warning(
        "Model %r was compiled with %s(...), which the Trainer cannot copy "
        "(%s): it trains that optimizer itself, adapted to its strategy. "
        "Compile the model again before a Keras fit.", model.name,
        type(optimizer).__name__, e)
    return optimizer
  if rate is not None:
    _set_learning_rate(copy, rate, f"model {model.name!r} was compiled with")
  if settings.get("fused_optimizer"):
    copy = fused_lib.fuse(copy)
  return copy


def _rate_owner(optimizer: Any, given: Any, where: str) -> Any:
  """The optimizer whose learning rate `learning_rate=given` would be (a
  `LossScaleOptimizer`'s inner one).

  Raises:
    ValueError: a `MultiOptimizer`, whose optimizers each have their own.
  """
  if _compat.optimizer_map(optimizer) is not None:
    raise ValueError(
        f"learning_rate={given} was given, but {where} a MultiOptimizer, "
        "whose optimizers each have their own learning rate. Set the rates "
        "on them and drop learning_rate=.")
  return getattr(optimizer, "inner_optimizer", None) or optimizer


def _set_learning_rate(optimizer: Any, rate: float, where: str) -> None:
  """Sets `optimizer`'s learning rate to `rate`, with a warning naming both.

  Raises:
    ValueError: it follows a schedule, or is a `MultiOptimizer`.
  """
  owner = _rate_owner(optimizer, rate, where)
  if _compat.learning_rate_variable(owner) is None:
    raise ValueError(
        f"learning_rate={rate} was given, but {where} an optimizer whose "
        "learning rate follows a schedule. Pass Trainer(optimizer=...) "
        "with the schedule you want, or drop learning_rate= to keep it.")
  logging.warning(
      "The Trainer was given learning_rate=%.6g, and %s %s at learning rate "
      "%.6g: it trains at %.6g.", rate, where, type(owner).__name__,
      float(owner.learning_rate), rate)
  owner.learning_rate = rate


def _set_in(options: Any) -> dict[str, Any]:
  """The fields of a `TrainerOptions` (or `None`) set away from their
  defaults."""
  if options is None:
    return {}
  return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
          if not _same(getattr(options, f.name), f.default)}


def _same(value: Any, default: Any) -> bool:
  if value is default:
    return True
  try:
    return bool(type(value) is type(default) and value == default)
  except (TypeError, ValueError):  # Arrays and the like: set by the user.
    return False


def _check_learning_rate(settings: dict[str, Any]) -> None:
  """Refuses `learning_rate=` next to an optimizer object with another
  learning rate: only a name takes it, and it went unused, silently."""
  optimizer = settings.get("optimizer")
  if "learning_rate" not in settings or optimizer is None or isinstance(
      optimizer, str):
    return
  given = settings["learning_rate"]
  own = _compat.learning_rate_variable(
      _rate_owner(optimizer, given, "optimizer= is"))
  if own is not None and float(own.numpy()) == float(
      tf.cast(given, own.dtype).numpy()):
    return
  rate = "a schedule" if own is None else f"{float(own.numpy()):.6g}"
  raise ValueError(
      f"learning_rate={given} was given with optimizer="
      f"{type(optimizer).__name__}(...), which has its own learning rate "
      f"({rate}): learning_rate= is used with an optimizer name only. Set "
      "the rate on the optimizer, or pass optimizer='adam' (or another "
      "name).")


def compiled_settings(model: keras.Model, options: Any,
                      settings: dict[str, Any]) -> dict[str, Any]:
  """`settings` (the `Trainer`'s keyword arguments) completed with what
  the model's own `compile()` set, for each of optimizer, loss, loss
  weights, metrics and `steps_per_execution` (above 1: batch callbacks run
  once per call, as under `fit`) not given, and logged: a compiled model
  trains as its `fit` would (it trained with the Trainer's defaults,
  silently). `jit_compile=True` is said, not taken (placements refuse it). A
  `learning_rate` given applies to the compiled optimizer, and
  `fused_optimizer=True` fuses it. A `TrainerOptions` given counts as
  keyword arguments for its fields set away from their defaults (it took
  nothing from compile: Adam at 1e-3 and cross-entropy instead). A
  placed model not compiled itself takes the `compile()` of the model it
  was split from (`placed_model.source_of`; the optimizer a fresh copy,
  never the source's own), as that model's `Trainer` would."""
  given = {**_set_in(options), **settings}
  _check_learning_rate(given)
  compiled = _compiled_model(model)
  if compiled is None:
    return settings
  names = [n for n in _FROM_COMPILE if n not in given]
  taken = {name: _compiled_value(compiled, name, given, compiled is model)
           for name in names}
  taken = {k: v for k, v in taken.items() if v is not None}
  if ("jit_compile" not in given
      and (compiled.get_compile_config() or {}).get("jit_compile") is True):
    logging.info("Model %r was compiled with jit_compile=True; the Trainer "
                 "compiles with XLA when given Trainer(jit_compile=True) "
                 "(--jit_compile), which placed models refuse.",
                 compiled.name)
  if taken:
    source = ("" if compiled is model else
              f" (split from it as {type(model).__name__} {model.name!r})")
    logging.info("Model %r was compiled%s: the Trainer takes its %s (pass "
                 "them to Trainer(...) to override).", compiled.name, source,
                 ", ".join(taken))
  return {**settings, **taken}


def _compiled_model(model: keras.Model) -> keras.Model | None:
  """`model` if compiled, else for a placed model the compiled model it
  was split from (a split dropped a keras_hub user's compile() silently:
  Adam at 1e-3 instead of SGD at 0.5), else `None`."""
  if getattr(model, "compiled", False):
    return model
  source = placed_model.source_of(model)
  return source if getattr(source, "compiled", False) else None
