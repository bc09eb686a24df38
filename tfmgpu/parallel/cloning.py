"""Rebuilding a model's layers elsewhere: what every split of a model needs.

A split (stages, tensor shards, a keras_hub model cut in two) rebuilds the
layers of a built model under other device scopes and moves weights
between the split and the unsplit model by layer name:

* `ModelSpec`: enough to rebuild the unsplit model (its class and config,
  its layer names, the weights its layers share).
* `clone_layer`: a fresh, unbuilt copy of one layer, named as the original;
  `copy_layer`: the same for a layer of a graph whose config does not
  round-trip (from its nested model's config, or `from_attributes`).
* `stage_inputs`: new `keras.Input`s standing for the tensors that enter a
  replayed part of a `graph.ModelGraph`.
* `weighted_layers` and `copy_weights`: weights by layer name, nested
  models looked into.
* `UnsplitWeights`: the mixin that gives a placed model `load_from`,
  `copy_weights_to` and `to_unsplit` (`placed_model.UnsplitForm`).
* `built_in_scope`: whether a model's weights were made in a strategy's
  scope (mirrored there), or need a copy made in it; `copy_model` makes
  that copy (or one in another dtype), as `predict` and `generate` do.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import shared as shared_lib


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Enough to rebuild the unsplit model (a plain object: Keras won't track it)."""
  cls: type
  config: dict | None
  layer_names: tuple[str, ...] = ()
  shared: tuple[shared_lib.SharedWeight, ...] = ()
  state: layer_state.LayerState | None = None  # Frozen weights, LoRA.
  source: Any = None  # A weak reference to the model split.
  # The user's layer classes by name: an unregistered one rebuilds too.
  classes: tuple[tuple[str, type], ...] = ()

  @classmethod
  def of(cls, model: keras.Model) -> "ModelSpec":
    """The spec of `model`; its config `None` when a layer's `get_config`
    raises (the split still copies that layer from its attributes; only
    `rebuild` needs the config, and says so)."""
    try:
      config = model.get_config()
    except NotImplementedError:
      config = None
    return cls(type(model), config, tuple(l.name for l in model.layers),
               shared_lib.find_shared(model.layers),
               layer_state.capture(model), weakref.ref(model),
               _users_classes(model))

  def rebuild(self, custom_objects: dict[str, Any] | None = None
              ) -> keras.Model:
    """A new model from the config, its layers named as the original's
    (`custom_objects` first, then the user's layer classes it held).

    Keras' automatic config of a custom layer holds only the arguments its
    constructor was given, so a layer Keras named gets a new name when
    rebuilt; weights move between layouts by layer name.
    """
    if self.config is None:
      raise ValueError(
          f"the unsplit {self.cls.__name__} cannot be rebuilt: a layer's "
          "get_config() raises NotImplementedError. Give each custom layer a "
          "get_config() that returns its constructor arguments; the split "
          "model trains and its checkpoints hold its weights.")
    # A copy: `Functional.from_config` consumes parts of the dict it gets,
    # and the model must rebuild from the same config every call.
    with _compat.copying_layers(), keras.saving.custom_object_scope(
        {**dict(self.classes), **(custom_objects or {})}):
      model = self.cls.from_config(copy.deepcopy(self.config))
    if len(model.layers) == len(self.layer_names):
      for layer, name in zip(model.layers, self.layer_names):
        layer.name = name
    # `from_config` of a plain functional model rebuilds a layer shared with
    # a nested model twice: tie the copies again.
    shared_lib.tie({l.name: l for l in model.layers}, self.shared,
                   "rebuilt model")
    if self.state is not None and model.built:
      layer_state.apply(self.state, model)
    return model


def _users_classes(model: keras.Model) -> tuple[tuple[str, type], ...]:
  """`(name, class)` of the user's own layer classes in `model`, by the
  name its config looks them up by (`get_registered_name`), so that
  `from_config` finds one not registered. A name two classes share is left
  out (Keras then says it cannot locate it), as is every library class:
  a user's `Dense` must not stand in for Keras' (nor Keras' for it)."""
  found: dict[str, set[type]] = {}
  for layer in _compat.flatten_layers(model):
    if checks.users_class(layer):
      kind = type(layer)
      found.setdefault(keras.saving.get_registered_name(kind), set()).add(kind)
  return tuple((name, next(iter(kinds))) for name, kinds in found.items()
               if len(kinds) == 1)


def weighted_layers(models: Sequence[keras.Model]) -> dict[str, Any]:
  """`{name: layer}` for the layers (not bare ops) of `models` with
  weights, and those of the models nested in them (a nested model's layers
  are planned and placed one by one: `graph.ModelGraph`); an outer layer
  keeps its name when a nested one has it too."""
  return _layers_by_name(models, lambda layer: bool(layer.weights))


def seeded_layers(models: Sequence[keras.Model]) -> dict[str, Any]:
  """`{name: layer}` for the layers of `models` (looked into as by
  `weighted_layers`) that hold random-seed state: a `Dropout`'s (or any
  layer's) `SeedGenerator`, which `get_weights` leaves out."""
  return _layers_by_name(models, lambda layer: bool(seed_states(layer)))


def _layers_by_name(models: Sequence[keras.Model],
                    keep: Callable[[Any], bool]) -> dict[str, Any]:
  found: dict[str, Any] = {}
  level = [l for m in models for l in m.layers]
  while level:
    for layer in level:
      if keep(layer):
        found.setdefault(layer.name, layer)
    level = [l for m in level if isinstance(m, keras.Model) for l in m.layers]
  return found


def seed_states(layer: keras.layers.Layer) -> list[Any]:
  """The seed generators' states of `layer` and its sublayers (a
  `Dropout`'s), which `get_weights` leaves out; the checkpoint's reading
  too (`training/seed_states.py`)."""
  return [g.state for l in _compat.flatten_layers(layer)
          for g in _compat.own_seed_generators(l)]


def copy_seed_states(src: dict[str, Any], dst: dict[str, Any]) -> None:
  """Each layer of `dst` named in `src` takes its seed states, so that it
  draws the random numbers (dropout masks) `src`'s would draw next: a copy
  made, trained and copied back continues one sequence, as the original
  training throughout would. Layers in one only, or holding other
  numbers of seed generators, keep theirs."""
  for name in set(src) & set(dst):
    theirs, mine = seed_states(src[name]), seed_states(dst[name])
    if len(theirs) == len(mine):
      for source, target in zip(theirs, mine):
        target.assign(np.asarray(source))


def copy_weights(src: dict[str, Any], dst: dict[str, Any],
                 names: Sequence[str], what: str) -> None:
  """`dst[name].set_weights(src[name].get_weights())` for each of `names`
  (`layer_state.set_weights`: adapted statistics recomputed).

  Raises:
    ValueError: a layer missing from either side, or weights that do not
      fit (`what` names the other model in the message).
  """
  for name in names:
    if name not in src or name not in dst:
      raise ValueError(
          f"layer {name!r} with weights is missing from the {what} model; "
          "both models must have the same architecture and layer names.")
    try:
      layer_state.set_weights(dst[name], src[name].get_weights())
    except ValueError as e:
      raise ValueError(f"cannot copy the weights of layer {name!r}: {e} Are "
                       "both models the same architecture?") from e


def clone_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
  """A fresh, unbuilt copy of a layer (nested models are cloned whole).

  From the layer's config; when the copy holds a constructor argument
  other than the original does (a config that drops it: keras_hub 0.32's
  `MixtralTransformerDecoder` loses `router_aux_loss_coef`), from the
  layer's attributes (`from_attributes`) instead.

  Raises:
    ValueError: the layer rebuilds neither from its config nor from its
      attributes, or no copy keeps every argument it kept.
  """
  with _compat.copying_layers():
    return _clone_layer(layer)


def _clone_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
  if _library_model(layer):
    return _from_own_config(layer)
  if isinstance(layer, keras.Model) and not _compat.overrides_call(layer):
    try:  # Keras' cloning keeps the graph, not a class's own call().
      clone = keras.models.clone_model(layer, recursive=True)
    except (ValueError, TypeError):
      pass  # Subclassed: fall through to its config.
    else:
      for old, new in zip(layer.layers, clone.layers):
        _check_kept(old, new)
      return clone
  try:
    clone = layer.__class__.from_config(layer.get_config())
  except (NotImplementedError, TypeError, ValueError) as e:
    if not checks.users_class(layer):  # keras_hub's: from its owner's.
      raise ValueError(
          f"layer {layer.name!r} ({type(layer).__name__}) cannot be rebuilt "
          f"from its config ({e}); give it a get_config() that returns its "
          "constructor arguments.") from e
    clone = from_attributes(layer, e)
  if isinstance(layer, keras.layers.Lambda):  # Its config's bytecode reads
    clone.function = layer.function  # Keras' globals, not the user's.
  if checks.lost_arguments(layer, clone):
    clone = from_attributes(layer, ValueError(
        "its config drops " + ", ".join(checks.lost_arguments(layer, clone))))
  _check_kept(layer, clone)
  clone.name = layer.name  # See `ModelSpec.rebuild`.
  return clone


def _library_model(layer: keras.layers.Layer) -> bool:
  """Whether `layer` is a functional model of a library's own class (a
  keras_hub backbone), which rebuilds by its class's `from_config`."""
  return (isinstance(layer, _compat.functional_class())
          and type(layer) is not _compat.functional_class()
          and not isinstance(layer, keras.Sequential)
          and not checks.users_class(layer))


def _build_like(clone: keras.Model, model: keras.Model) -> None:
  """Builds `clone` on the shapes `model` was built on (a subclassed
  model has no `input_shape`: Keras recorded the shapes of its first call)."""
  build_config = model.get_build_config()
  if build_config:
    clone.build_from_config(build_config)
  else:
    clone.build(model.input_shape)


def _from_own_config(model: keras.Model) -> keras.Model:
  """A copy of a library's functional model (a keras_hub backbone) by its
  class's own `from_config`, as a split copies its blocks (`copy_layer`):
  Keras' recursive cloning rebuilt each block from the block's config,
  which raises (Llama's: no attribute 'rope_scaling_factor') or drops an
  argument (Qwen's `sliding_window_size`), and lost the class.

  Raises:
    ValueError: a layer of the copy differs from the original's.
  """
  clone = type(model).from_config(copy.deepcopy(model.get_config()))
  for old, new in zip(model.layers, clone.layers):
    _check_kept(old, new)
  clone.name = model.name
  return clone


def settle(layer: keras.layers.Layer, clone: keras.layers.Layer) -> None:
  """After a copy's first call (built): its frozen flags, LoRA and
  vocabularies as the layer's (`layer_state.mirror`), and a user's layer
  whose built copy holds other plain attributes refused by name.

  Raises:
    ValueError: the copy differs (see `_check_kept`).
  """
  layer_state.mirror(layer, clone)
  _check_kept(layer, clone, checks.changed_attributes(layer, clone))


def _check_kept(layer: keras.layers.Layer, clone: keras.layers.Layer,
                lost: list[str] | None = None) -> None:
  lost = checks.lost_arguments(layer, clone) if lost is None else lost
  if lost:
    raise ValueError(
        f"layer {layer.name!r} ({type(layer).__name__}) does not rebuild "
        f"as it is: its copy differs in {', '.join(lost)}, so a split "
        "model would train another model. Give the layer a get_config() "
        "that returns every constructor argument.")


def from_attributes(layer: keras.layers.Layer,
                     error: Exception) -> keras.layers.Layer:
  """A copy of `layer` built from the attributes named as its constructor's
  arguments (for a layer whose `get_config` fails but which keeps each
  argument under its own name); raises `error` when one is missing."""
  kwargs = {"name": layer.name, "dtype": layer.dtype_policy,
            "trainable": layer.trainable}
  for p in list(inspect.signature(type(layer).__init__).parameters.values()
                )[1:]:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in kwargs:
      continue
    if not hasattr(layer, p.name):
      if p.default is p.empty:
        why = " ".join(str(error).split())  # Keras' own spans lines.
        raise ValueError(
            f"layer {layer.name!r} ({type(layer).__name__}) cannot be "
            f"rebuilt: its config fails ({why[:300]}) and it keeps no "
            f"attribute {p.name!r} to rebuild it from. Give it a get_config() "
            "that returns its constructor arguments"
            + (", and let its __init__ take **kwargs for super().__init__ "
               "(name, trainable, dtype)" if "unexpected keyword" in why
               else "") + ".") from error
      continue
    kwargs[p.name] = _fresh_argument(getattr(layer, p.name))
  return type(layer)(**kwargs)


def _fresh_argument(value: Any) -> Any:
  """A constructor argument for a copy: a layer (a hand-written tied head
  holding the `Embedding`) becomes a built copy of its own, so the copy
  never holds the user's layer (the ties of the split then swapped the
  user's weights for the split's); lists and tuples of them likewise."""
  if isinstance(value, (list, tuple)):
    return type(value)(_fresh_argument(v) for v in value)
  if not isinstance(value, keras.layers.Layer):
    return value
  clone = _clone_layer(value)
  if value.built and not clone.built:
    clone.build_from_config(value.get_build_config())
  return clone


def copy_layer(graph: graph_lib.ModelGraph, layer: keras.layers.Layer,
               fresh: dict[int, keras.Model]) -> keras.layers.Layer:
  """A fresh copy of one of `graph`'s layers, on the current device scope.

  From the layer's config, or, when that does not round-trip (keras_hub
  0.32's `LlamaTransformerDecoder.get_config` raises), the same layer of a
  copy of the nested model that holds it, rebuilt from the nested model's
  own config (once per `fresh` cache: one stage's).
  """
  try:
    return clone_layer(layer)
  except (AttributeError, KeyError, ValueError) as e:
    owner = graph.owner(layer)
    if owner is None:
      if checks.users_class(layer):  # `clone_layer` tried its attributes.
        raise
      clone = from_attributes(layer, e)
      _check_kept(layer, clone)
      return clone
  if id(owner) not in fresh:
    fresh[id(owner)] = type(owner).from_config(
        copy.deepcopy(owner.get_config()))
  clone = fresh[id(owner)].get_layer(layer.name)
  _check_kept(layer, clone)
  return clone


def stage_inputs(graph: graph_lib.ModelGraph, start: int, k: int):
  """New inputs for replaying `graph` from node `start` (stage `k`):
  `(structure of new keras.Inputs, {id(old tensor): new input})`.

  Stage 0 takes the model's inputs as the model does (one tensor, a list or
  a dict); a later stage takes the tensors crossing into it: one tensor, or
  a list of them in `ModelGraph.crossing` order.
  """
  new_input = lambda t, name: keras.Input(shape=tuple(t.shape)[1:],
                                          dtype=t.dtype, name=name)
  if start == 0:
    old = graph.input_structure
    names = iter(t.name for t in tf.nest.flatten(old))
    new = tf.nest.map_structure(lambda t: new_input(t, next(names)), old)
  else:
    old = graph.crossing(start)
    new = [new_input(t, f"stage_{k}_input" if len(old) == 1 else
                     f"stage_{k}_input_{i}") for i, t in enumerate(old)]
    old, new = (old[0], new[0]) if len(old) == 1 else (old, new)
  mapping = graph.tensor_map()  # Nested models' tensors stand for ours.
  for o, n in zip(tf.nest.flatten(old), tf.nest.flatten(new)):
    mapping[id(o)] = n
  return new, mapping


def check_same_weights(model: keras.Model, paths: Sequence[str], made: str,
                       again: str) -> None:
  """Raises when `model` has weights added or removed since a placement
  was made of it (`paths`: its weights' paths then; `made`: "split into
  StagedModel 'x'"): the placement holds only the weights it had, so new
  ones (`enable_lora()`'s) would not train and the ones it has would, in
  full, silently. `again` says how to place the model anew.

  Raises:
    ValueError: naming the weights added and removed, and what to do.
  """
  now = [v.path for v in model.weights]
  before, after = set(paths), set(now)
  added = [p for p in now if p not in before]
  removed = [p for p in paths if p not in after]
  if not added and not removed:
    return
  said = [f"{len(items)} {what} ({_some(items)})" for items, what in
          ((added, "added"), (removed, "removed")) if items]
  raise ValueError(
      f"model {model.name!r} was {made} and then had weights added or "
      f"removed: {'; '.join(said)}. The placement was made for the "
      "weights the model had then and would not train the model as it now "
      "is (after enable_lora(), a split went on training every base weight "
      "in full and no LoRA weight). Call enable_lora() (or change the "
      f"model) before placing it, or {again}.")


def _some(paths: Sequence[str]) -> str:
  """The first three of `paths`, joined, with ", ..." when there are more."""
  return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")


class UnsplitWeights:
  """Weights to and from the unsplit model, by layer name.

  For a placed model whose layers keep the unsplit model's names and show
  their weights in unsplit form: it provides `weighted_layers()` and
  `_unsplit_spec` (a `ModelSpec` of the unsplit model).
  """

  _unsplit_spec: ModelSpec

  def weighted_layers(self) -> dict[str, Any]:
    raise NotImplementedError

  @property
  def unsplit_spec(self) -> ModelSpec:
    """The unsplit model's class and config (e.g. to read a keras_hub
    backbone's sizes)."""
    return self._unsplit_spec

  @property
  def source_model(self) -> keras.Model | None:
    """The model this one was split from, while it lives (held by a weak
    reference: the split does not keep it alive)."""
    spec = self._unsplit_spec
    return spec.source() if spec.source is not None else None

  def check_source_unchanged(self) -> None:
    """Raises when the model this one was split from now has other weights
    than when it was split (`enable_lora()` adds LoRA weights and freezes
    the base), or trains other ones (keras.io's fine-tuning sets
    `base_model.trainable = True` between two fits): the split's copies
    keep the weights and flags they were made with, so the change was
    ignored (the base moved by 0.0, or trained in full under LoRA),
    silently.

    Raises:
      ValueError: naming the weights and what to do.
    """
    spec, model = self._unsplit_spec, self.source_model
    if model is None or spec.state is None:
      return
    made = f"split into {type(self).__name__} {self.name!r}"
    check_same_weights(model, spec.state.paths, made,
                       "split the model again (placed.copy_weights_to(model) "
                       "first keeps what the split trained)")
    now = tuple(bool(v.trainable) for v in model.weights)
    if now == spec.state.variables:
      return
    changed = [v.path for v, was in zip(model.weights, spec.state.variables)
               if bool(v.trainable) != was]
    raise ValueError(
        f"model {model.name!r} was {made} and then changed which weights "
        f"train ({_some(changed)}): the split's copies keep the flags they "
        "were made with. Copy what the split trained back "
        "(placed.copy_weights_to(model)) and split the model again, or set "
        "layer.trainable before splitting.")

  def load_from(self, unsplit: keras.Model) -> None:
    """Copies the weights of the unsplit model into this one (and its
    layers' seed states: dropout continues where the unsplit's stopped)."""
    mine = self.weighted_layers()
    copy_weights(weighted_layers([unsplit]), mine, list(mine), "unsplit")
    copy_seed_states(seeded_layers([unsplit]), seeded_layers([self]))

  def copy_weights_to(self, unsplit: keras.Model) -> None:
    """Copies this model's weights into an unsplit model of the same
    architecture (and its layers' seed states: its dropout continues
    where this model's stopped)."""
    mine = self.weighted_layers()
    copy_weights(mine, weighted_layers([unsplit]), list(mine), "unsplit")
    copy_seed_states(seeded_layers([self]), seeded_layers([unsplit]))

  def to_unsplit(self, *, device: str | None = None,
                 custom_objects: dict[str, Any] | None = None) -> keras.Model:
    """Rebuilds the unsplit model (on `device`) holding this one's weights.

    Args:
      device: where the new model's variables go. Defaults to the current
        device scope.
      custom_objects: custom layer classes, if the model uses any.

    Returns:
      A new, unsplit model.
    """
    spec = self._unsplit_spec
    place = (tf.device(devices_lib.resolve_devices([device])[0]) if device
             else contextlib.nullcontext())
    with place:
      model = spec.rebuild(custom_objects)
    self.copy_weights_to(model)
    return model


def built_in_scope(model: keras.Model,
                   strategy: tf.distribute.Strategy) -> bool:
  """Whether `model`'s weights were made in `strategy`'s scope (so each
  replica holds its own copy); `True` for a model without weights."""
  v = model.weights[0] if model.weights else None
  return v is None or strategy.extended.variable_created_in_scope(
      getattr(v, "value", v))


def copy_model(model: keras.Model,
               strategy: tf.distribute.Strategy | None = None, *,
               dtype: str | None = None,
               same_class: bool = False) -> keras.Model:
  """A copy of `model` holding the same weights, built in `strategy`'s
  scope (the current scope when `None`), optionally in another dtype.

  The weights are read first, outside `strategy`'s scope: a model built
  under another strategy object can only be read outside it (TF raises
  "Mixing different tf.distribute.Strategy objects"). Keras' cloning makes
  a plain functional copy; with `same_class` (or a `dtype`) the copy is
  built by the model's own class's `from_config`, so a keras_hub task
  keeps its methods (such as `call_with_cache`). Weights the model shares
  between layers (a tied embedding) stay one weight in the copy: Keras'
  cloning makes each layer its own.
  """
  weights = model.get_weights()
  scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
  graph = _compat.has_graph(model)
  with scope, _compat.copying_layers():
    if dtype is None and not same_class and graph:  # Attributes kept.
      clone = keras.models.clone_model(model, clone_function=_clone_layer)
    else:
      clone = _from_class_config(model, dtype)
    if not clone.built:
      _build_like(clone, model)
    shared_lib.tie({l.name: l for l in clone.layers},
                   shared_lib.find_shared(model.layers), "copy")
    layer_state.mirror(model, clone)
    layer_state.set_weights(clone, weights)
  return clone


def _from_class_config(model: keras.Model, dtype: str | None) -> keras.Model:
  """`model` rebuilt by its class's `from_config` (in `dtype`).

  Raises:
    ValueError: a subclassed model whose config does not rebuild it (Keras
      cloning takes only functional and Sequential models, and said so of
      its `clone_function` argument, a new user's trial), or rebuilds it
      with other constructor arguments than it holds now (`m.scale = 2.0`
      after it was made: its copy would predict with 1.0).
  """
  try:
    # A copy: `Functional.from_config` consumes parts of the dict it gets.
    config = copy.deepcopy(model.get_config())
    clone = type(model).from_config(
        config if dtype is None else _with_dtype(config, dtype))
    if not _compat.has_graph(model):
      _check_kept(model, clone)  # Its own attributes: no graph to copy.
    return clone
  except (NotImplementedError, TypeError, ValueError) as e:
    if _compat.has_graph(model):
      raise
    raise ValueError(
        f"model {model.name!r} ({type(model).__name__}, a subclassed "
        "keras.Model) must be copied here (into a strategy's scope, or "
        "another dtype), and its get_config()/from_config() do not rebuild "
        f"it: {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
        "Build it in the strategy's scope and pass that strategy object "
        "(strategy=s, not a name, which makes a new one), serve it with no "
        "strategy, give the class a get_config() returning its __init__ "
        "arguments, or write it as a functional model.") from e


def _with_dtype(config: Any, dtype: str) -> Any:
  """Rewrites every layer's floating `dtype` in a (nested) model config;
  integer and string inputs keep theirs (token ids rounded to bfloat16
  read other rows: 301 became 300)."""
  if isinstance(config, dict):
    out = {k: _with_dtype(v, dtype) for k, v in config.items()}
    if "dtype" in out and _floating(config.get("dtype")) and (
        "name" in config or "units" in config or "filters" in config):
      out["dtype"] = dtype
    return out
  if isinstance(config, list):
    return [_with_dtype(c, dtype) for c in config]
  return config


def _floating(value: Any) -> bool:
  """Whether a config's `dtype` (a name, or a serialized `DTypePolicy`) is
  a floating one (or a mixed policy)."""
  if isinstance(value, dict):
    value = (value.get("config") or {}).get("name", value.get("name"))
  return isinstance(value, str) and (value.startswith(("float", "bfloat"))
                                     or value.startswith("mixed"))
