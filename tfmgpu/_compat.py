"""Every use of Keras' and TensorFlow's private API, in one place.

tfmgpu needs a few things neither library exposes publicly: walking a
functional model's layer graph, a tensor's Keras mask, a compiled model's
loss and loss tracker, an optimizer's strategy, learning-rate variable, slot
variables and built-in all-reduce, whether TensorFlow's runtime has started,
and a few strategy internals. Each is one small function here, so that a
Keras or TensorFlow upgrade that moves one breaks one function, and
`tests/test_compat.py` says which. No other module of the package imports
`keras.src` or `tensorflow.python` or reads these private attributes
(`tests/test_compat.py` greps for them).

The shims were checked against the versions in `CHECKED`; importing this
module on other versions warns once (`check_versions` returns the reasons).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Callable
import warnings

import keras
import numpy as np
import tensorflow as tf

# Minor versions (inclusive) the shims below were checked against. Widen a
# range after `pytest tests/test_compat.py` passes on the new version.
CHECKED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "keras": ((3, 15), (3, 15)),
    "tensorflow": ((2, 21), (2, 21)),
}


def _minor(version: str) -> tuple[int, int] | None:
  """`"3.15.1"` -> `(3, 15)`; `None` when the string has no major.minor."""
  found = re.match(r"(\d+)\.(\d+)", version)
  return (int(found.group(1)), int(found.group(2))) if found else None


def check_versions(versions: dict[str, str] | None = None) -> list[str]:
  """Why the installed (or given) versions are outside `CHECKED`.

  Args:
    versions: `{"keras": ..., "tensorflow": ...}` version strings. Defaults
      to the installed `keras.__version__` and `tf.__version__`.

  Returns:
    One sentence per library outside its checked range; empty when both are
    inside.
  """
  if versions is None:
    versions = {"keras": keras.__version__, "tensorflow": tf.__version__}
  problems = []
  for name, (low, high) in CHECKED.items():
    found = _minor(versions[name])
    if found is None or not low <= found <= high:
      problems.append(
          f"{name} {versions[name]} is outside {low[0]}.{low[1]}.."
          f"{high[0]}.{high[1]}, the versions tfmgpu's shims for its private "
          "API (tfmgpu/_compat.py) were checked against")
  return problems


def _warn_outside_checked_versions() -> None:
  problems = check_versions()
  if problems:
    warnings.warn(
        "; ".join(problems) + ". Run `pytest tests/test_compat.py` to see "
        "whether each shim still works, or install versions in that range.",
        RuntimeWarning, stacklevel=3)


_warn_outside_checked_versions()


# TensorFlow.


def runtime_initialized() -> bool:
  """Whether TensorFlow's runtime (and so its device layout) has started."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return context.context()._context_handle is not None  # pylint: disable=protected-access


def onednn_enabled() -> bool | None:
  """Whether TensorFlow's oneDNN CPU kernels are on (`TF_ENABLE_ONEDNN_OPTS`,
  else TensorFlow's default for this CPU, off on some); `None` when this
  TensorFlow cannot say. Starts no runtime."""
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return None


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` spans several worker processes."""
  extended = getattr(strategy, "extended", None)
  check = getattr(extended, "_in_multi_worker_mode", None)
  return bool(check()) if check is not None else False


def parameter_server_workers(strategy: tf.distribute.Strategy) -> int:
  """The number of workers of a `ParameterServerStrategy` (1 if unknown)."""
  return getattr(strategy, "_num_workers", 1)


def collective_keys(group_key_start: int) -> Any:
  """A new TF `CollectiveKeys`: the group and instance key counters a
  collective all-reduce draws from (thread safe)."""
  from tensorflow.python.distribute import cross_device_utils  # pylint: disable=g-import-not-at-top
  return cross_device_utils.CollectiveKeys(group_key_start=group_key_start)


def rekey_collectives(strategy: tf.distribute.Strategy, keys: Any) -> int:
  """Points every collective all-reduce a `MirroredStrategy` holds (its
  cross-device ops, and the one TF keeps for XLA) at `keys`, under the group
  key `keys` gives that all-reduce's devices.

  Instance keys are drawn when a function is called, so functions traced
  before draw them from `keys` too, under the group key they were traced
  with; `keys`' counters for the devices are first raised past the old
  ones, so those functions never draw an instance key already used there.

  Returns:
    How many all-reduce objects now use `keys` (0: the strategy has none,
    e.g. `ReductionToOneDevice` and no XLA one, or TF moved them).
  """
  from tensorflow.python.distribute import cross_device_ops  # pylint: disable=g-import-not-at-top
  extended = strategy.extended
  found = {id(o): o for o in (getattr(extended, "_cross_device_ops", None),
                              getattr(extended, "_collective_ops", None))}
  changed = 0
  for ops in found.values():
    launchers = getattr(ops, "_launchers", None)
    if not isinstance(ops, cross_device_ops.CollectiveAllReduce) or not (
        launchers and all(hasattr(l, "_group_key") for l in launchers)):
      continue
    group = keys.get_group_key([l._device for l in launchers])  # pylint: disable=protected-access
    old = ops._collective_keys  # pylint: disable=protected-access
    used = old._instance_key_table.get(launchers[0]._group_key, {})  # pylint: disable=protected-access
    with keys._lock:  # pylint: disable=protected-access
      counters = keys._instance_key_table[group]  # pylint: disable=protected-access
      for device, next_key in used.items():
        counters[device] = max(counters.get(device, next_key), next_key)
    for launcher in launchers:
      launcher._group_key = group  # pylint: disable=protected-access
      launcher._collective_keys = keys  # pylint: disable=protected-access
    ops._collective_keys = keys  # pylint: disable=protected-access
    changed += 1
  return changed


Trackable = tf.__internal__.tracking.Trackable
AutoTrackable = tf.__internal__.tracking.AutoTrackable


# The Keras layer graph.


def squeeze_or_expand_to_same_rank(y_true: Any, y_pred: Any) -> tuple[Any, Any]:
  """What Keras' loss wrapper does to a loss function's arguments before
  it calls it: a last axis of 1 squeezed or added so both ranks agree
  ((N,) labels against an (N, 1) output no longer broadcast to (N, N))."""
  from keras.src.losses import loss as loss_lib  # pylint: disable=g-import-not-at-top
  return loss_lib.squeeze_or_expand_to_same_rank(y_true, y_pred)


def keras_history(tensor: keras.KerasTensor) -> tuple[Any, int, int]:
  """`(operation, node_index, tensor_index)`: where a symbolic tensor was
  made (what `keras.Model` itself uses to walk its graph)."""
  return tuple(tensor._keras_history)  # pylint: disable=protected-access


def producer_node(tensor: keras.KerasTensor) -> Any:
  """The node (one call of a layer or op) that made a symbolic tensor."""
  op, node_index, _ = keras_history(tensor)
  return op._inbound_nodes[node_index]  # pylint: disable=protected-access


def model_operations(model: keras.Model) -> list[Any]:
  """A model's layers and bare ops (`keras.ops.*` calls) in its own order;
  its layers when it lists no ops."""
  return list(getattr(model, "_operations", None) or model.layers)


def functional_class() -> type:
  """Keras' `Functional` model class (a functional model called as a layer
  is one; `keras.Model(inputs, outputs)` returns one)."""
  from keras.src.models import functional  # pylint: disable=g-import-not-at-top
  return functional.Functional


def is_functional(layer: Any) -> bool:
  """A functional model (not a subclassed one) whose graph is its call."""
  functional = functional_class()
  return isinstance(layer, functional) and type(layer).call is functional.call


def stateless_call(model: keras.Model, trainable: Any, non_trainable: Any,
                   *args, return_losses: bool = False, **kwargs) -> Any:
  """`model.stateless_call(...)`, except that the model is called as Keras'
  `fit` calls it (`model(...)`, not `model.call(...)`) inside the stateless
  scope: with the autocast scope that opens (mixed precision), and
  without a `training` argument its `call` does not take.

  Keras' `stateless_call` runs `call` with no autocast scope, so a layer
  that does not autocast (Keras' `Embedding`, keras_hub's
  `ReversibleEmbedding`) opened one of its own; and with one opened around
  it, the given values were rounded to the compute dtype on the way in. A
  mixed_bfloat16 Llama's logits came out 4.5e-4 from Keras' call either
  way (called inside a mixed-precision model's own call, as in
  `ShardedModel.predict`, too); and a subclassed model whose `call` takes
  no `training` failed.

  Returns:
    `(outputs, non-trainable values)`, and the losses with `return_losses`.
  """
  from keras.src import backend  # pylint: disable=g-import-not-at-top
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  mapping = (list(zip(model.trainable_variables, trainable))
             + list(zip(model.non_trainable_variables, non_trainable)))
  # No autocast scope while the values are taken: each kept in its
  # variable's own dtype (an open scope rounded float32 weights to
  # bfloat16; an `AutocastScope(None)` made a bfloat16 model's float32).
  outer = global_state.get_global_attribute("autocast_scope")
  global_state.set_global_attribute("autocast_scope", None)
  try:
    scope = backend.StatelessScope(state_mapping=mapping,
                                   collect_losses=return_losses)
  finally:
    global_state.set_global_attribute("autocast_scope", outer)
  with scope:
    outputs = model(*args, **kwargs)
    losses = model.losses if return_losses else None
  state = [scope.get_current_value(v) for v in model.non_trainable_variables]
  return (outputs, state, losses) if return_losses else (outputs, state)


def has_graph(model: Any) -> bool:
  """A Sequential or functional model, whose layer graph is what it
  computes (not a subclassed model, nor a functional one overriding
  `call()`)."""
  return isinstance(model, keras.Sequential) or is_functional(model)


def overrides_call(layer: Any) -> bool:
  """A functional model whose class overrides `call()`: its graph (inputs
  to outputs) is not what it computes."""
  functional = functional_class()
  return isinstance(layer, functional) and type(layer).call is not functional.call


def flatten_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
  """`layer` and all its nested layers, depth first."""
  return list(layer._flatten_layers())  # pylint: disable=protected-access


def child_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
  """The layers `layer` holds directly (not theirs), in tracking order."""
  return list(layer._flatten_layers(include_self=False, recursive=False))  # pylint: disable=protected-access


def own_seed_generators(layer: keras.layers.Layer) -> list[Any]:
  """The Keras `SeedGenerator`s `layer` itself holds (a `Dropout`'s), not
  those of its nested layers; each keeps its state in `.state`."""
  return list(layer._seed_generators)  # pylint: disable=protected-access


def replace_tracked_variable(layer: keras.layers.Layer, old: Any,
                             new: Any) -> None:
  """Makes `layer`'s own variable stores hold `new` where they held `old`.

  Keras' `Tracker.replace_tracked_value` finds `old` with `list.index`,
  which compares variables with `==` (an element-wise op that fails for two
  variables of different shapes in the same store, such as an untied
  `ReversibleEmbedding`'s table and its transpose): found by identity here.
  """
  tracker = getattr(layer, "_tracker", None)
  if tracker is None:
    return
  locked = tracker.locked
  tracker.unlock()
  try:
    for store in ("trainable_variables", "non_trainable_variables"):
      if id(old) not in tracker.stored_ids.get(store, ()):
        continue
      values = tracker.config[store][1]
      values[next(i for i, v in enumerate(values) if v is old)] = new
      tracker.stored_ids[store].remove(id(old))
      tracker.stored_ids[store].add(id(new))
    for name, value in list(vars(layer).items()):
      if value is old:
        setattr(layer, name, new)
  finally:
    if locked:
      tracker.lock()


def replace_sublayer(root: keras.layers.Layer, old: keras.layers.Layer,
                     new: keras.layers.Layer) -> None:
  """Makes the layer inside `root` that holds sublayer `old` (as an
  attribute) hold `new` instead, `old` dropped from its tracked layers."""
  for parent in flatten_layers(root):
    names = [n for n, v in vars(parent).items() if v is old]
    if not names or parent is old:
      continue
    tracker = parent._tracker  # pylint: disable=protected-access
    locked = tracker.locked
    tracker.unlock()
    try:
      if id(old) in tracker.stored_ids.get("layers", ()):
        values = tracker.config["layers"][1]
        del values[next(i for i, v in enumerate(values) if v is old)]
        tracker.stored_ids["layers"].remove(id(old))
      for name in names:
        setattr(parent, name, new)
    finally:
      if locked:
        tracker.lock()


@contextlib.contextmanager
def no_deferred_initialization() -> Iterator[None]:
  """Forgets the variables Keras defers while the block runs.

  Keras 3 records a variable made in a stateless scope in a global list,
  which the next top-level stateless scope initialises; the list is put
  back as it was on exit.
  """
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  key = "uninitialized_variables"
  before = list(global_state.get_global_attribute(key, [],
                                                  set_to_default=True))
  try:
    yield
  finally:
    global_state.set_global_attribute(key, before)


# Keras masks.


def copying_layers() -> contextlib.AbstractContextManager:
  """Keras' safe mode off while a live model's layers are rebuilt from
  their configs: a `Lambda` (the user's own function, in memory) would
  refuse "the deserialization of a Lambda layer" as if read from a file."""
  from keras.src.saving import serialization_lib  # pylint: disable=g-import-not-at-top
  return serialization_lib.SafeModeScope(False)


def get_keras_mask(tensor: Any) -> Any:
  """The Keras mask a tensor carries, or `None`."""
  from keras.src.backend.common import masking  # pylint: disable=g-import-not-at-top
  return masking.get_keras_mask(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
  """Attaches a Keras mask to a tensor (in place)."""
  from keras.src.backend.common import masking  # pylint: disable=g-import-not-at-top
  masking.set_keras_mask(tensor, mask)


# A compiled model's loss.


def compiled_loss(model: keras.Model) -> Callable[..., Any] | None:
  """The loss `compile(loss=...)` made, called as `(y_true, y_pred,
  sample_weight)`; `None` before `compile` or without a loss."""
  return model._compile_loss  # pylint: disable=protected-access


def compiled_metrics(model: keras.Model, name: str) -> Any:
  """What `compile(metrics=...)` (`name="metrics"`) or `weighted_metrics`
  was given, the user's own objects; `None` when nothing was."""
  container = getattr(model, "_compile_metrics", None)  # pylint: disable=protected-access
  return getattr(container, f"_user_{name}", None)


def loss_tracker(model: keras.Model) -> keras.metrics.Metric:
  """The mean metric behind the `loss` that `fit` reports."""
  return model._loss_tracker  # pylint: disable=protected-access


def unscale_loss_for_distribution(value: Any) -> Any:
  """A per-replica loss times the replicas in sync (as Keras' own
  `train_step` records it)."""
  from keras.src.losses import loss as keras_loss  # pylint: disable=g-import-not-at-top
  return keras_loss.unscale_loss_for_distribution(value)


# Optimizers.


def optimizer_strategy(optimizer: Any) -> Any:
  """The `tf.distribute` strategy a Keras optimizer was created in (or
  `None`)."""
  return getattr(optimizer, "_distribution_strategy", None)


def weight_decay_exclusions(optimizer: Any) -> set[Any]:
  """The keys of the variables a Keras optimizer excludes from weight decay
  by object (`exclude_from_weight_decay(var_list=...)`)."""
  return set(getattr(optimizer, "_exclude_from_weight_decay", None) or ())


def set_weight_decay_exclusions(optimizer: Any, keys: set[Any]) -> None:
  """Excludes the variables of `keys` (as `weight_decay_exclusions` gives
  them) from `optimizer`'s weight decay, keeping its name patterns."""
  optimizer._exclude_from_weight_decay = set(keys)  # pylint: disable=protected-access
  optimizer._exclude_from_weight_decay_cache = {}  # pylint: disable=protected-access


def attention_gated(layer: Any) -> bool:
  """Whether a Keras `MultiHeadAttention` gates its heads
  (`use_gate=True`: a projection of the query, by heads, not split)."""
  return bool(getattr(layer, "_use_gate", False))


def each_optimizer(optimizer: Any) -> Iterator[Any]:
  """`optimizer`, then every optimizer it wraps (a `LossScaleOptimizer`'s
  inner one, a `MultiOptimizer`'s), depth first, in a fixed order."""
  pending = [optimizer]
  while pending:
    opt = pending.pop(0)
    yield opt
    inner = getattr(opt, "inner_optimizer", None)
    pending[:0] = ([inner] if inner is not None else []) + list(
        getattr(opt, "optimizers", None) or [])


def optimizer_map(optimizer: Any) -> Any:
  """A Keras `MultiOptimizer`'s map (an `OptimizerMap`, or the function it
  was given), or `None` for any other optimizer."""
  return getattr(optimizer, "_optimizer_map", None)


def optimizer_pairs(source: Any, copy: Any) -> Iterator[tuple[Any, Any]]:
  """`(source, copy)` and each pair of optimizers they wrap, matched by
  role (a `LossScaleOptimizer`'s inner one; a `MultiOptimizer`'s default
  and each key of its `OptimizerMap`), not by position: one optimizer under
  two keys is two optimizers in a copy from config."""
  yield source, copy
  inner = getattr(source, "inner_optimizer", None)
  if inner is not None:
    yield from optimizer_pairs(inner, copy.inner_optimizer)
  a, b = optimizer_map(source), optimizer_map(copy)
  if hasattr(a, "default_optimizer") and hasattr(b, "default_optimizer"):
    yield from optimizer_pairs(a.default_optimizer, b.default_optimizer)
    for key in a:
      yield from optimizer_pairs(a[key], b[key])


def copy_optimizer(optimizer: Any, cls: Any = None,
                   **config: Any) -> Any:
  """An unbuilt copy of a Keras optimizer (of class `cls`, default its
  own), from its config with `config` over it, created in the current
  scope. What the config leaves out is carried over to the copy and to
  each optimizer it wraps: the weight-decay exclusions, by object and by
  name (`exclude_from_weight_decay(var_list=..., var_names=...)`)."""
  copy = (cls or type(optimizer)).from_config(
      {**optimizer.get_config(), **config})
  for source, target in optimizer_pairs(optimizer, copy):
    set_weight_decay_exclusions(target, weight_decay_exclusions(source))
    target._exclude_from_weight_decay_pattern = getattr(  # pylint: disable=protected-access
        source, "_exclude_from_weight_decay_pattern", None)
  return copy


def variable_key(optimizer: Any, variable: Any) -> Any:
  """How a Keras optimizer keys `variable` (weight-decay exclusions)."""
  return optimizer._var_key(variable)  # pylint: disable=protected-access


def learning_rate_variable(optimizer: Any) -> Any:
  """The variable holding a Keras optimizer's learning rate; `None` when it
  follows a schedule."""
  variable = getattr(optimizer, "_learning_rate", None)
  return variable if hasattr(variable, "assign") else None


def replace_gradient_all_reduce(
    optimizer: Any, all_reduce: Callable[[Any], Any]) -> bool:
  """Replaces the all-reduce a Keras optimizer runs in `apply_gradients`
  under a strategy with `all_reduce(grads_and_vars)`, on this instance.

  Returns:
    Whether the optimizer had one to replace.
  """
  if not hasattr(optimizer, "_all_reduce_sum_gradients"):
    return False
  optimizer._all_reduce_sum_gradients = all_reduce  # pylint: disable=protected-access
  return True


def variable_storage(variable: Any) -> Any:
  """The `tf.Variable` behind a Keras variable (its `value` is a cast
  tensor under a mixed-precision autocast scope)."""
  return variable._value  # pylint: disable=protected-access


def variable_shards(variable: Any) -> list[Any] | None:
  """The parts of a variable a `ParameterServerStrategy` split over its
  servers (`variable_partitioner`: its value is a `ShardedVariable`), in
  order along the first axis; `None` for a variable kept whole."""
  value = (variable_storage(variable) if isinstance(variable, keras.Variable)
           else variable)
  if isinstance(value, tf.__internal__.distribute.ShardedVariable):
    return list(value.variables)
  return None


def make_shards_whole(variables: Any) -> int:
  """Makes each Keras variable of `variables` whose value a parameter-server
  strategy split (`variable_shards`) save, restore and read into numpy as
  one whole variable: a checkpoint holds it under the key and value an
  unsplit variable has, and `model.save` writes it as one array.

  A Keras 3 variable saves the tensors its value serializes, else its value
  as one tensor, and reads into numpy through its value's `__array__`; a
  `ShardedVariable` serializes none (it saves through TF's older
  saveables), is no tensor and has no `__array__`, so the first checkpoint
  failed ("no attribute 'device'"), and so did `model.save`. The value is
  given them here: its read (the parts joined) and its `assign` (each part
  its slice).

  Returns:
    How many variables were split.
  """
  count = 0
  for variable in variables:
    if variable_shards(variable) is None:
      continue
    value = variable_storage(variable)
    value._serialize_to_tensors = (  # pylint: disable=protected-access
        lambda value=value: {"VARIABLE_VALUE": tf.convert_to_tensor(value)})
    value._restore_from_tensors = (  # pylint: disable=protected-access
        lambda tensors, value=value: value.assign(tensors["VARIABLE_VALUE"]))
    value.__array__ = (lambda dtype=None, value=value:
                       np.asarray(value.numpy(), dtype=dtype))
    count += 1
  return count


def rehome_variable(variable: Any, device: str) -> None:
  """Moves a Keras variable's storage to `device` (a new `tf.Variable`
  there, holding the same value; the Keras variable object, which layers,
  optimizers and checkpoints hold, stays the same)."""
  value = variable.value
  with tf.init_scope(), tf.device(device):
    moved = tf.Variable(tf.identity(value), dtype=value.dtype,
                        trainable=variable.trainable,
                        name=variable.name)
  variable._value = moved  # pylint: disable=protected-access


def trackable_children(obj: Any, save_type: str = "checkpoint",
                       **kwargs) -> dict[str, Any]:
  """The children a TF checkpoint saves under `obj` (its keys' next part)."""
  return obj._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access


def optimizer_checkpoint_keys(optimizer: keras.optimizers.Optimizer,
                              prefix: str = "optimizer"
                              ) -> dict[str, tuple[tuple[int, ...], str]]:
  """`{checkpoint key: (shape, path)}` of what a Keras optimizer saved as
  `prefix` writes: the variables it was built for (the model's trainable
  ones) and its own (iterations, learning rate, slots), by position."""
  own = {id(optimizer.iterations), id(learning_rate_variable(optimizer))}
  keys = {}
  for attribute, variables in (
      ("_trainable_variables", optimizer._trainable_variables),  # pylint: disable=protected-access
      ("_variables", optimizer._variables)):  # pylint: disable=protected-access
    for i, v in enumerate(variables):
      if id(v) not in own:  # Saved under their own names.
        keys[f"{prefix}/{attribute}/{i}/.ATTRIBUTES/VARIABLE_VALUE"] = (
            tuple(v.shape), str(getattr(v, "path", v.name)))
  return keys


def variable_index(optimizer: keras.optimizers.Optimizer, variable: Any
                   ) -> int:
  """The index of `variable` in the optimizer's slot lists."""
  return optimizer._get_variable_index(variable)  # pylint: disable=protected-access


def adam_slots(optimizer: keras.optimizers.Adam, variable: Any
               ) -> tuple[Any, Any]:
  """`(first moment, second moment)` slot variables of `variable` in a
  Keras `Adam` (or `AdamW`)."""
  index = variable_index(optimizer, variable)
  return (optimizer._momentums[index],  # pylint: disable=protected-access
          optimizer._velocities[index])  # pylint: disable=protected-access


def export_input_signature(model: keras.Model) -> Any:
  """The input signature `model.export` gives a model's serving endpoint
  (Keras' `export_utils.get_input_signature`)."""
  from keras.src.export import export_utils  # pylint: disable=g-import-not-at-top
  return export_utils.get_input_signature(model)
