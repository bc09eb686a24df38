"""Input checks with one wording each: name the argument, echo the value,
state the rule, give the fix.

Every layer (config, registries, engines, CLIs) raises through these, so a
rule reads the same wherever it is caught. Importing this module imports
nothing heavy.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable
from typing import Any


def did_you_mean(value: Any, choices: Iterable[Any]) -> str:
  """` Did you mean 'mirrored'?` for a near miss of `choices`, else `""`."""
  names = [str(c) for c in choices]
  close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
  return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
  """Raises `ValueError` unless `value` is one of `choices`."""
  choices = tuple(choices)
  if value not in choices:
    hint = did_you_mean(value, choices)
    raise ValueError(f"{name}={value!r} is unknown.{hint} Choose one of "
                     f"{', '.join(str(c) for c in choices)}.")


def check_positive(name: str, value: Any, *, allow_none: bool = False) -> None:
  """Raises `ValueError` unless `value` is an int >= 1 (or allowed `None`)."""
  if value is None and allow_none:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer.")


def check_divisible(name: str, value: int, divisor: int, what: str) -> None:
  """Raises `ValueError` unless `divisor` divides `value`.

  Args:
    name: the argument, e.g. `"global_batch_size"`.
    value: its value.
    divisor: what it must be a multiple of.
    what: the divisor in words, e.g. `"the 4 replicas of 'mirrored'"` or
      `"micro_batches=4"`.
  """
  if value % divisor:
    lower = max(divisor, value // divisor * divisor)
    raise ValueError(f"{name}={value} is not divisible by {what}. Use a "
                     f"multiple of {divisor}, e.g. {lower} or {lower + divisor}.")


_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
  if isinstance(value, (tuple, list)):
    return all(_plain(v) for v in value)
  return isinstance(value, _PLAIN)


def _attribute(obj: Any, name: str) -> Any:
  """`obj.name`, or `None` when it has none or its property fails."""
  try:
    return getattr(obj, name, None)
  except Exception:  # pylint: disable=broad-except
    return None


def lost_arguments(original: Any, clone: Any) -> list[str]:
  """The constructor arguments `original` (a Keras layer, optimizer, ...)
  keeps as attributes of their own name (plain values: numbers, strings,
  flags and tuples of them) that `clone` holds otherwise, as
  `name=original (copy: value)`: what a copy from config lost."""
  lost = []
  for name in list(inspect.signature(type(original).__init__).parameters)[1:]:
    if name in ("name", "dtype", "trainable"):
      continue
    a, b = _attribute(original, name), _attribute(clone, name)
    if not (_plain(a) and _plain(b)):
      continue
    if all(v is None or isinstance(v, (list, tuple)) for v in (a, b)):
      a, b = tuple(a or ()), tuple(b or ())  # [] == () == None.
    if a != b:
      lost.append(f"{name}={a!r} (copy: {b!r})")
  return lost


# Packages whose layers rebuild from their configs as they are, and whose
# state updates tfmgpu knows: only a user's own classes are looked into.
_LIBRARIES = ("keras", "keras_hub", "tfmgpu", "tensorflow", "tf_keras")
_MISSING = object()


def users_class(obj: Any) -> bool:
  """Whether `obj`'s class is the user's own (not Keras', keras_hub's,
  TF's or tfmgpu's)."""
  return type(obj).__module__.split(".")[0] not in _LIBRARIES


@functools.cache
def _base_layer_attributes() -> frozenset[str]:
  """The attributes every Keras layer holds (one probe layer, named, so
  Keras' automatic layer names are not advanced)."""
  import keras  # pylint: disable=g-import-not-at-top
  return frozenset(vars(keras.layers.Layer(name="tfmgpu_probe")))


def changed_attributes(original: Any, copy: Any) -> list[str]:
  """The plain attributes (numbers, strings, flags, tuples of them) a
  user's built layer holds that its built copy holds otherwise, as
  `name=original (copy: value)`: a constructor argument its config drops
  and that it keeps under another name (`self._scale = alpha * 2`), which
  `lost_arguments` cannot see. Layers of Keras, keras_hub and tfmgpu are
  not compared (their configs round-trip)."""
  if not users_class(original):
    return []
  base = _base_layer_attributes()
  changed = []
  for name, value in vars(original).items():
    if name in base or name.startswith("_self_") or not _plain(value):
      continue
    other = vars(copy).get(name, _MISSING)
    if other is _MISSING or other != value:
      changed.append(f"{name}={value!r} (copy: "
                     f"{'none' if other is _MISSING else repr(other)})")
  return changed


# The steps of `keras.Model` a subclass overrides to change what `fit`,
# `evaluate` or `predict` computes.
KERAS_STEPS = ("train_step", "test_step", "predict_step", "compute_loss")


def overridden_steps(model: Any,
                     names: Iterable[str] = KERAS_STEPS) -> list[str]:
  """Which of `names` (Keras model steps) `model`'s class overrides."""
  import keras  # pylint: disable=g-import-not-at-top
  return [name for name in names
          if getattr(type(model), name, None) is not getattr(keras.Model,
                                                             name, None)]


def refuse_custom_steps(model: Any, label: str = "model") -> None:
  """Raises when a model to be split or sharded overrides a Keras step.

  A split model (stages, tensor shards, their copies, ZeRO's shards) runs
  its own steps, per device; a step the user's class overrides would not
  run, so the split would silently train (or predict) something else.

  Args:
    model: the Keras model to be split.
    label: what the user called it in the error (e.g. `"branches[1]"`).

  Raises:
    ValueError: naming the model, its class and the steps.
  """
  custom = overridden_steps(model)
  if custom:
    raise ValueError(
        f"{label} {getattr(model, 'name', '')!r} ({type(model).__name__}) "
        f"overrides {', '.join(custom)}: a split or sharded model runs its "
        "own steps on each device and would not call it, so it would train "
        "or predict something else. Put extra loss terms in a layer (a "
        "custom layer's call() with self.add_loss(...), or a "
        "kernel_regularizer: split models keep layers' losses), or keep the "
        "model whole and use data parallelism: model.fit under "
        "tfmgpu.get_strategy('mirrored').scope(). To only serve it split, "
        "split a plain functional view of it: keras.Model(model.input, "
        "model.output).")


def stateful_layers(model: Any) -> list[str]:
  """The names of `model`'s stateful layers (`stateful=True`: Keras' RNNs,
  a `Bidirectional` of them, `ConvLSTM2D`), at any depth; the layers
  inside a stateful one are not named again."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  if not isinstance(model, keras.layers.Layer):
    return []  # A SavedModel's serving function, say.
  found, level = [], _compat.child_layers(model)
  while level:
    found += [l.name for l in level if getattr(l, "stateful", None) is True]
    level = [c for l in level if getattr(l, "stateful", None) is not True
             for c in _compat.child_layers(l)]
  return found


def training_norms(models: Any, synchronized: bool | None = None
                   ) -> list[str]:
  """The names of the `BatchNormalization` layers in `models` (a model or
  layer, or a list of them; nested layers included) that normalise by the
  batch's own statistics in training: each part of a split batch (a
  replica's rows, a micro-batch) by its own.

  Those that are trainable: a frozen one (`trainable=False`) uses its
  moving statistics. One recorded in a functional graph with
  `training=False` (keras.io's `base(x, training=False)`) is listed too:
  Keras 3.15 lets the model's call-time `training=True` (what `fit`
  passes) override it, so it trains on the batch's statistics.
  `synchronized`: only those with (`True`) or without (`False`)
  `synchronized=True`; `None` (the default), all.
  """
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  items = models if isinstance(models, (list, tuple)) else [models]
  found = {id(l): l for item in items if isinstance(item, keras.layers.Layer)
           for l in _compat.flatten_layers(item)
           if isinstance(l, keras.layers.BatchNormalization) and l.trainable
           and synchronized in (None, bool(getattr(l, "synchronized", False)))}
  return [layer.name for layer in found.values()]


def random_layers(models: Any) -> list[str]:
  """The names of the layers in `models` (a model or layer, or a list of
  them; nested layers included) that draw random numbers when training:
  those holding a Keras `SeedGenerator` (dropout, noise, augmentation such
  as `RandomFlip`), except a dropout or noise of rate (stddev) 0."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  items = models if isinstance(models, (list, tuple)) else [models]
  found = {id(l): l for item in items if isinstance(item, keras.layers.Layer)
           for l in _compat.flatten_layers(item)
           if _compat.own_seed_generators(l)
           and getattr(l, "rate", getattr(l, "stddev", 1)) != 0}
  return [layer.name for layer in found.values()]


def say_random_draws(name: str, models: Any, how: str) -> None:
  """Warns that `models`' random layers (`random_layers`) draw `how` (e.g.
  "for each of the 4 micro-batches"), so a run follows other draws than
  one device's: the same in distribution, other weights."""
  names = random_layers(models)
  if names:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning(
        "%s: layers drawing random numbers in training (%s) draw them %s, "
        "not as one device draws them for the whole batch: the same in "
        "distribution, but other draws, so the weights differ from a "
        "one-device run. To compare layouts exactly, set their rates to 0.",
        name, shown_names(names), how)


def shown_names(names: list[str], most: int = 4) -> str:
  """`names` joined for a message, the first `most` of them."""
  return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


def refuse_stateful_layers(model: Any, layout: str,
                           label: str = "model") -> None:
  """Raises when `model` holds stateful RNN layers (`stateful_layers`)
  and is to run `layout` (over several devices), which cannot keep their
  state: Keras keeps it in variables of the layer's fixed batch size,
  carried from each batch to the next; replicas would run their different
  rows against the one state, and splits and shards run the layer without
  it (or fail deep in Keras).

  Args:
    model: the Keras model to be placed, sharded or replicated.
    layout: how it would run, after "cannot run", e.g. `"split by
      StagedModel"` or `"under MirroredStrategy (2 replicas)"`.
    label: what the user called it in the error (e.g. `"branches[1]"`).

  Raises:
    ValueError: naming the stateful layers, and what runs them.
  """
  names = stateful_layers(model)
  if not names:
    return
  shown = ", ".join(repr(n) for n in names[:4]) + (
      ", ..." if len(names) > 4 else "")
  raise ValueError(
      f"{label} {getattr(model, 'name', '')!r} has stateful RNN layers "
      f"({shown}: stateful=True), which cannot run {layout}: Keras keeps "
      "their state in variables of the layer's fixed batch size, carried "
      "row by row from one batch to the next; replicas would run their "
      "different rows against the one state, and splits and shards run "
      "the layer without it. Stateful RNNs run on one device "
      "(tfmgpu.Trainer(model) or tfmgpu.predict(model, x) with no strategy "
      "of several replicas); or make them stateless (stateful=False) and "
      "pass the state in with initial_state=...")
