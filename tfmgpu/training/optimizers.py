"""Optimizers by name: the registry behind `--optimizer`.

Importing this module does not import TensorFlow or Keras (the CLIs list
`OPTIMIZER_CHOICES` in `--help`); `make_optimizer` and `prepare_optimizer`
(the optimizer a Trainer runs, built in its strategy's scope) load them.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

from tfmgpu._lazy import LazyModule

keras = LazyModule("keras")
_compat = LazyModule("tfmgpu._compat")
checks = LazyModule("tfmgpu.checks")
placed_model = LazyModule("tfmgpu.parallel.placed_model")
sharded = LazyModule("tfmgpu.training.sharded")

_OPTIMIZERS: dict[str, Callable[..., Any]] = {
    "adam": lambda **kw: keras.optimizers.Adam(**kw),
    "sgd": lambda **kw: keras.optimizers.SGD(**kw),
    "momentum": lambda **kw: keras.optimizers.SGD(momentum=0.9, **kw),
    "rmsprop": lambda **kw: keras.optimizers.RMSprop(**kw),
    "adamw": lambda **kw: keras.optimizers.AdamW(**kw),
}
OPTIMIZER_CHOICES = tuple(_OPTIMIZERS)


def make_optimizer(name: str, learning_rate: float, *,
                   clip_norm: float | None = None,
                   fused: bool = True) -> "keras.optimizers.Optimizer":
  """Builds an optimizer by name (see `OPTIMIZER_CHOICES`).

  Args:
    name: one of `OPTIMIZER_CHOICES`.
    learning_rate: the step size (> 0).
    clip_norm: the optimizer's own `global_clipnorm` (the Trainer clips the
      all-reduced gradient itself and passes `None`).
    fused: use the one-kernel update of `tfmgpu.training.fused` where one
      exists (Adam, AdamW, SGD); same math as the Keras class.

  Raises:
    ValueError: unknown name or a learning rate that is not > 0.
  """
  if name not in _OPTIMIZERS:
    raise ValueError(f"optimizer={name!r} is unknown. Choose one of "
                     f"{', '.join(OPTIMIZER_CHOICES)}.")
  if not learning_rate > 0:
    raise ValueError(f"learning_rate={learning_rate} must be > 0.")
  kwargs = {"global_clipnorm": clip_norm} if clip_norm else {}
  optimizer = _OPTIMIZERS[name](learning_rate=learning_rate, **kwargs)
  if not fused:
    return optimizer
  from tfmgpu.training import fused as fused_lib  # pylint: disable=g-import-not-at-top
  return fused_lib.fuse(optimizer)


# Optimizers whose update of an element reads that element's gradient and
# slots only: a weight split into shards updates as the whole weight would.
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop",
                "Adagrad", "Adadelta", "Ftrl", "Lion")
# Optimizers that hand each variable to optimizers they wrap.
_WRAPPERS = ("LossScaleOptimizer", "MultiOptimizer")
# Why the others are not: each reads a whole variable.
_WHOLE_VARIABLE = {
    "Adafactor": "factors its second moments by the variable's rows and "
                 "columns and clips by its RMS",
    "Lamb": "scales each variable's step by its own trust ratio (norms)",
    "Muon": "orthogonalises each matrix's update",
}


def whole_variable_use(optimizer: Any) -> str | None:
  """Why `optimizer` updates a variable from more than each element's own
  gradient and slots (so a weight split into shards would update
  differently from the whole weight), or `None` when it does not.

  Unknown optimizer classes are reported too, as tfmgpu cannot tell,
  unless they say `elementwise = True`.
  """
  for opt in _compat.each_optimizer(optimizer):
    why = _whole_variable_use_of(opt)
    if why:
      return why
  return None


def check_splits(optimizer: Any, model: Any) -> None:
  """Refuses an optimizer that would update the shards of `model`'s split
  weights (tensor, vocabulary or head parallelism) otherwise than their
  whole weights: one that reads whole variables (`whole_variable_use`),
  or a `MultiOptimizer` that routes shards by path (`split_routing`).

  Raises:
    ValueError: naming the split layers and what to use instead.
  """
  _check_copies(optimizer, model)
  layers = [l for l in _compat.flatten_layers(model)
            if hasattr(l, "_unsplit_layout")]
  if not layers:
    return
  reason = whole_variable_use(optimizer)
  fix = ("Use an element-wise optimizer (Adam, AdamW, SGD, RMSprop, Lion, "
         "...; global_clipnorm instead of clipnorm)")
  if not reason:
    reason = split_routing(optimizer, layers)
    fix = "Leave the split layers to the map's default optimizer"
  if reason:
    split = sorted({l.name for l in layers})
    raise ValueError(
        f"optimizer: {reason}, but {type(model).__name__} {model.name!r} "
        f"splits the weights of {', '.join(split[:4])}"
        f"{' ...' if len(split) > 4 else ''} into shards, which it would "
        f"update one by one, unlike the whole weights. {fix}, or use a "
        "layout with tensor=1.")


def _check_parts(optimizer: Any, model: Any, parts: int) -> None:
  """Refuses an optimizer that reads whole variables when parameter servers
  split some of `model`'s variables in parts (`--variable_shards`): each
  part is updated alone (`sharded.trainable_parts`), so Lamb's trust ratio
  or a `clipnorm` would be taken per part."""
  whole = len(model.trainable_variables)
  reason = whole_variable_use(optimizer) if parts != whole else None
  if reason:
    raise ValueError(
        f"optimizer: {reason}, but the parameter servers split the "
        f"{whole} trainable variables of model {model.name!r} into {parts} "
        "parts (--variable_shards), which it would update one by one, "
        "unlike the whole variables. Use an element-wise optimizer (Adam, "
        "AdamW, SGD, RMSprop, Lion, ...; global_clipnorm instead of "
        "clipnorm), or --variable_shards=1.")


def _check_copies(optimizer: Any, model: Any) -> None:
  """Refuses `global_clipnorm` over a model holding data-parallel copies of
  each weight (`ReplicatedModel`): Keras takes the norm over every copy's
  (equal) gradients, sqrt(R) times the model's, and clipped that much too
  hard."""
  copies = placed_model.data_copies(model)
  norms = [opt.global_clipnorm for opt in _compat.each_optimizer(optimizer)
           if getattr(opt, "global_clipnorm", None)]
  if copies > 1 and norms:
    raise ValueError(
        f"optimizer: global_clipnorm={norms[0]} clips the norm of all the "
        f"gradients it applies, and {type(model).__name__} {model.name!r} "
        f"holds {copies} data-parallel copies of each weight, whose equal "
        f"gradients would count {copies} times (clipping sqrt({copies}) "
        "times too hard). Pass clip_norm= to tfmgpu.Trainer instead (the "
        "norm of one copy's), clip each weight with clipnorm=, or use a "
        "layout with data=1.")


def split_routing(optimizer: Any, split_layers: Any) -> str | None:
  """Why a `MultiOptimizer` in `optimizer` might send the shards of a split
  weight to another optimizer than the whole weight (its map routes by
  variable path, and shards have their own paths: `kernel_0`, ...), or
  `None` when each split layer's variables all reach its default one
  and no key of its map names a split layer."""
  for opt in _compat.each_optimizer(optimizer):
    routes = _compat.optimizer_map(opt)
    if routes is None:
      continue
    if not isinstance(routes, keras.optimizers.OptimizerMap):
      return ("a MultiOptimizer with a function for optimizer_map, so "
              "tfmgpu cannot tell which optimizer each shard reaches (give "
              "it a keras.optimizers.OptimizerMap)")
    for layer in split_layers:
      named = [k for k in routes if layer.name in k]
      paths = [p for v in layer.trainable_variables
               for p in (v.path, re.sub(r"_\d+$", "", v.path))]
      routed = [p for p in paths if routes[p] is not routes.default_optimizer]
      if named or routed:
        return (f"a MultiOptimizer whose OptimizerMap routes split layer "
                f"{layer.name!r} by path ({(named or routed)[0]!r}), and its"
                " shards' paths differ from its whole weights'")
  return None


def _whole_variable_use_of(optimizer: Any) -> str | None:
  """`whole_variable_use` of one optimizer, not those it wraps."""
  name = type(optimizer).__name__
  if getattr(optimizer, "clipnorm", None):
    return (f"clipnorm={optimizer.clipnorm} clips each variable by its own "
            "norm (global_clipnorm, over all variables, splits exactly)")
  for cls_name, why in _WHOLE_VARIABLE.items():
    if isinstance(optimizer, getattr(keras.optimizers, cls_name, ())):
      return f"{name} {why}"
  known = tuple(getattr(keras.optimizers, n)
                for n in _WRAPPERS + _ELEMENTWISE)
  if not isinstance(optimizer, known) and not getattr(
      optimizer, "elementwise", False):
    return (f"{name} is not one of the element-wise optimizers tfmgpu "
            f"knows ({', '.join(_ELEMENTWISE)}; set `optimizer.elementwise "
            "= True` on one whose update of each element reads only that "
            "element's gradient and slots)")
  return None


def _uses_float16(model: "keras.Model") -> bool:
  """Whether Keras' `compile` would scale `model`'s loss: its own dtype
  policy (a placed model's source's) is `mixed_float16`. Not its layers':
  a float32 model around a float16 sub-model gets no `LossScaleOptimizer`
  from Keras either."""
  return placed_model.dtype_policy_of(model) == "mixed_float16"


def loss_scaled_for(model: "keras.Model", optimizer: Any) -> Any:
  """`optimizer` wrapped in a `LossScaleOptimizer` when Keras' `compile`
  of `model` would wrap it (`_uses_float16`: a placed model's source's
  policy is `mixed_float16`) and it is not one already; else `optimizer`."""
  if optimizer is None or not _uses_float16(model) or isinstance(
      optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer
  return keras.optimizers.LossScaleOptimizer(optimizer)


def _strategies_of(optimizer: Any) -> list[Any]:
  """The strategies `optimizer` (and a wrapped inner one) were created in."""
  return [_compat.optimizer_strategy(opt)
          for opt in _compat.each_optimizer(optimizer)]


def _bind_to(optimizer: Any, strategy: Any) -> Any:
  """`optimizer`, or an unbuilt copy of it created in `strategy`'s scope.

  Keras optimizers bind to the strategy current when they are created, and
  creating their slots under another one fails in TensorFlow ("Mixing
  different tf.distribute.Strategy objects"). An optimizer that has not
  built its slots yet is re-created from its config, in the scope the
  caller has entered; a built one cannot move.

  Raises:
    ValueError: `optimizer` is bound elsewhere and cannot be re-created.
  """
  if all(s is None or s is strategy for s in _strategies_of(optimizer)):
    return optimizer
  fix = ("Create it inside `with strategy.scope():` (the strategy passed "
         "here), or pass its name, e.g. optimizer='adam'.")
  name = f"{type(optimizer).__name__}(name={getattr(optimizer, 'name', '')!r})"
  if getattr(optimizer, "built", False):
    raise ValueError(
        f"optimizer={name} was created outside this strategy's scope and "
        f"has already built its slot variables, so it cannot move. {fix}")
  try:
    return copy_of(optimizer)
  except ValueError as e:
    raise ValueError(
        f"optimizer={name} was created outside this strategy's scope and "
        f"could not be re-created: {e}. {fix}") from e


def copy_of(optimizer: Any, cls: Any = None, **config: Any) -> Any:
  """An unbuilt copy of `optimizer` from its config (of class `cls`, with
  `config` over it; `_compat.copy_optimizer`), checked to keep every
  constructor argument each optimizer in it keeps as an attribute.

  Raises:
    ValueError: the config does not make a copy, or the copy lost an
      argument (a subclass whose `get_config` leaves one out); the message
      says which.
  """
  try:
    copy = _compat.copy_optimizer(optimizer, cls, **config)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"its config does not make a copy ({type(e).__name__}:"
                     f" {e})") from e
  lost = [f"{type(a).__name__} {what}"
          for a, b in _compat.optimizer_pairs(optimizer, copy)
          for what in checks.lost_arguments(a, b)]
  if lost:
    raise ValueError(f"its copy from config differs in {', '.join(lost)} "
                     "(give its class a get_config() that returns every "
                     "constructor argument)")
  return copy


def check_exclusions(optimizer: Any, variables: Any, trained: str) -> None:
  """Refuses an optimizer that excludes variables from weight decay by
  object (`exclude_from_weight_decay(var_list=...)`) that are not among
  `variables` (those `trained` trains): the decay would apply to their
  copies, unnoticed.

  Raises:
    ValueError: naming how many excluded variables are not trained.
  """
  missing = set()
  for opt in _compat.each_optimizer(optimizer):
    keys = _compat.weight_decay_exclusions(opt)
    missing |= keys - {_compat.variable_key(opt, v) for v in variables}
  if missing:
    raise ValueError(
        f"optimizer: exclude_from_weight_decay(var_list=...) names "
        f"{len(missing)} variable(s) that {trained} does not train: it "
        "trains copies of the model's variables (placed over devices, or "
        "made in a strategy's scope), and the weight decay would apply to "
        "them unnoticed. Exclude them by name instead, which follows the "
        "copies: optimizer.exclude_from_weight_decay(var_names=['gamma', "
        "'beta', 'bias', ...]).")


def leaves(optimizer: Any) -> list[Any]:
  """The optimizers that update variables in `optimizer`: itself, or those
  it wraps (a `LossScaleOptimizer`'s inner one, a `MultiOptimizer`'s)."""
  wrappers = tuple(getattr(keras.optimizers, n) for n in _WRAPPERS)
  return [o for o in _compat.each_optimizer(optimizer)
          if not isinstance(o, wrappers)]


def _check_own_clipping(optimizer: Any, clip_norm: float | None) -> None:
  """Refuses a `clip_norm` for the optimizer to apply (where the strategy
  sums gradients: parameter servers) that an optimizer object would not:
  only a name takes it."""
  own = [getattr(o, "global_clipnorm", None) for o in leaves(optimizer)]
  if clip_norm and (not own or any(c != clip_norm for c in own)):
    raise ValueError(
        f"clip_norm={clip_norm} with optimizer={type(optimizer).__name__}"
        "(...): where the strategy sums the gradients (parameter servers) "
        "the optimizer clips them, and an optimizer object is used as "
        f"given (its global_clipnorm: {', '.join(map(str, own)) or 'none'})"
        f". Create it with global_clipnorm={clip_norm}, or pass an "
        "optimizer name (optimizer='adam', ...) with clip_norm.")


def _check_accumulation(optimizer: Any, strategy: Any) -> None:
  """Refuses Keras gradient accumulation under a distribution strategy:
  Keras applies the accumulated gradients inside a `tf.cond`, where a
  distributed update cannot run (TF fails with "`merge_call` called while
  defining a new graph")."""
  steps = getattr(optimizer, "gradient_accumulation_steps", None)
  overwrite = (getattr(optimizer, "use_ema", False)
               and getattr(optimizer, "ema_overwrite_frequency", None))
  if not (steps or overwrite):
    return
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.init_scope():
    if (not tf.distribute.has_strategy()
        and strategy is tf.distribute.get_strategy()):
      return  # TF's default strategy: one device, no update to sync.
  name, under = type(optimizer).__name__, type(strategy).__name__
  if not steps:  # The same tf.cond, around the averages' overwrite.
    raise ValueError(
        f"optimizer={name}(use_ema=True, ema_overwrite_frequency="
        f"{overwrite}) cannot train under {under}: Keras overwrites the "
        "weights with their moving averages inside a tf.cond, where a "
        "distributed update cannot run. Leave ema_overwrite_frequency "
        "unset: Trainer.fit puts the averages in the weights when it ends.")
  raise ValueError(
      f"optimizer={name}(gradient_accumulation_steps={steps}) cannot train "
      f"under {under}: Keras "
      "applies accumulated gradients inside a tf.cond, where a distributed "
      "update cannot run. Leave gradient_accumulation_steps unset and "
      f"multiply global_batch_size by {steps} instead (the same mean "
      "gradient per update); to hold one micro-batch's activations at a "
      f"time, run that batch in {steps} micro-batches on each copy: "
      "build_layout(model, Layout(data=<copies>, micro_batches="
      f"{steps}, schedule='1f1b')) from tfmgpu.parallel (CLI: "
      f"--strategy=pipeline --num_stages=1 --micro_batches={steps} "
      "--schedule=1f1b --data_parallel=<copies>).")


def prepare_optimizer(optimizer: Any, model: "keras.Model",
                      strategy: Any, *,
                      learning_rate: float, clip_norm: float | None,
                      fused: bool) -> "keras.optimizers.Optimizer":
  """The optimizer to train with, built in `strategy`'s scope.

  A name becomes an optimizer (`make_optimizer`); float16 models get a
  `LossScaleOptimizer`; slots are created now, in the scope (Keras 3 needs
  that before a distributed step), on each stage's device for staged
  models (their `build_optimizer`). An optimizer object created outside
  the scope is re-created in it from its config (see `_bind_to`).

  Raises:
    ValueError: an optimizer object bound to another strategy that cannot
      be re-created (already built, or its config does not round-trip), or
      one accumulating gradients under a distribution strategy.
  """
  with strategy.scope():
    if isinstance(optimizer, str):
      optimizer = make_optimizer(optimizer, learning_rate,
                                 clip_norm=clip_norm, fused=fused)
    else:
      _check_accumulation(optimizer, strategy)
      _check_own_clipping(optimizer, clip_norm)
      optimizer = _bind_to(optimizer, strategy)
    optimizer = loss_scaled_for(model, optimizer)
    variables = sharded.trainable_parts(model)  # Split ones: their parts.
    _check_parts(optimizer, model, len(variables))
    check_exclusions(optimizer, variables, f"model {model.name!r}")
    check_splits(optimizer, model)
    build = getattr(model, "build_optimizer", None)
    if build is not None:
      build(optimizer)  # Staged models place each stage's slots themselves.
    else:
      optimizer.build(variables)
  return optimizer


@contextlib.contextmanager
def optimizer_on_model(model: keras.Model,
                       optimizer: keras.optimizers.Optimizer):
  """`model.optimizer` is `optimizer` while `fit` runs, as in Keras `fit`:
  callbacks read and set it (`ReduceLROnPlateau`, `LearningRateScheduler`).
  Restored after: the Trainer's optimizer does not all-reduce by itself
  (`allreduce.take_over_aggregation`), so a later `model.fit` must not pick
  it up."""
  missing = object()
  before = getattr(model, "optimizer", missing)
  model.optimizer = optimizer
  try:
    yield
  finally:
    if before is missing:
      del model.optimizer
    else:
      model.optimizer = before
