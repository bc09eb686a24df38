"""Parallel sub-models on separate devices, on the same input, plus a combine step.

`BranchParallel` runs towers, ensemble members or experts side by side: branch
`i` keeps its variables on `devices[i]` and runs there, forward and backward
(its own `tf.GradientTape`, differentiated under its device with the gradient
of its output from the combine step). The outputs meet on `combine_device`
and are concatenated, averaged, summed, or passed to a Keras layer or a
callable. Each branch can load its own weights file.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable, Union

import keras
import tensorflow as tf

from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import placed as placed_lib
from tfmgpu.parallel import shared as shared_lib

BranchSpec = Union[keras.Model, Callable[[], keras.Model]]

_COMBINE = {
    "concat": lambda outs: tf.concat(outs, axis=-1),
    "sum": tf.add_n,
    "mean": lambda outs: tf.add_n(outs) / len(outs),
}


def _takes_one_per_branch(fn: Callable[..., Any], count: int) -> bool:
  """Whether `fn` is called as `fn(out_1, ..., out_n)` rather than
  `fn([out_1, ..., out_n])`: it binds `count` arguments but not one."""
  return count > 1 and _binds(fn, count) and not _binds(fn, 1)


def _binds(fn: Callable[..., Any], n: int) -> bool:
  """Whether `fn` accepts `n` positional arguments (unknown: yes for 1)."""
  try:
    inspect.signature(fn).bind(*range(n))
    return True
  except TypeError:
    return False
  except ValueError:  # No signature (a builtin): assume the list form.
    return n == 1


def _checked_callable(fn: Callable[..., Any], specs: Sequence[Any]
                      ) -> Callable[[list], Any]:
  """`fn` as `combine(list)`, traced once on the branches' output specs.

  Raises:
    ValueError: `fn` takes neither one list nor one argument per branch,
      or fails on outputs of these shapes.
  """
  per_branch = _takes_one_per_branch(fn, len(specs))
  name = getattr(fn, "__name__", repr(fn))
  if not per_branch and not _binds(fn, 1):
    raise ValueError(
        f"combine={name!r} takes neither one list of outputs nor one argument "
        f"per branch ({len(specs)} branches): its signature is "
        f"{inspect.signature(fn)}. Use fn(outputs) or fn(out_1, ..., "
        f"out_{len(specs)}).")
  combine = (lambda outs: fn(*outs)) if per_branch else fn
  tensor_specs = [tf.TensorSpec(s.shape, s.dtype) for s in specs]
  try:
    tf.function(lambda *outs: combine(list(outs)),
                autograph=False).get_concrete_function(
        *tensor_specs)
  except Exception as e:  # pylint: disable=broad-except  (reported, named)
    shapes = [tuple(s.shape) for s in specs]
    how = ("one argument per branch" if per_branch
           else "the list of branch outputs")
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    raise ValueError(
        f"combine={name!r} fails when called with {how} (shapes {shapes}): "
        f"{type(e).__name__}: {reason}. It must take "
        "one list, fn(outputs), or one argument per branch, fn(out_1, ..., "
        "out_n), and return a tensor.") from e
  return combine


def _place(spec: BranchSpec, device: str, index: int) -> keras.Model:
  """Returns branch `index` with its variables on `device`."""
  if not isinstance(spec, keras.Model):
    if not callable(spec):
      raise TypeError(f"branches[{index}]={spec!r} is neither a keras.Model "
                      "nor a callable that builds one.")
    with tf.device(device):
      model = spec()
    if not isinstance(model, keras.Model):
      raise TypeError(f"branches[{index}]() returned {model!r}, not a "
                      "keras.Model.")
  else:
    model = spec
  if not model.built:
    raise ValueError(
        f"branches[{index}] ({model.name!r}) is not built; give it a "
        "keras.Input or call build(input_shape) first.")
  # The branches' calls run inside this model's steps, never their own.
  checks.refuse_custom_steps(model, f"branches[{index}]")
  if all(devices_lib.canonical_device(placed_lib.variable_device(v)) == device
         for v in model.variables):
    return model  # Already on its device (or built there by the callable).
  with tf.device(device):
    try:
      clone = keras.models.clone_model(model, recursive=True)
    except (ValueError, TypeError, NotImplementedError) as e:
      raise ValueError(
          f"branches[{index}] ({model.name!r}) cannot be cloned onto {device} "
          f"({e}). Pass a callable that builds it instead; it will be called "
          "under the device.") from e
  # Keras' clone makes a weight its layers share (a tied embedding) two.
  shared_lib.tie({l.name: l for l in clone.layers},
                 shared_lib.find_shared(model.layers), f"branches[{index}]")
  layer_state.mirror(model, clone)
  layer_state.set_weights(clone, model.get_weights())
  return clone


def _check_not_shared(branches: Sequence[BranchSpec]) -> None:
  """Refuses branches that share a weight: each branch is placed (and
  cloned) on its own, so the weight would become one per branch.

  Raises:
    ValueError: naming the weight and the branches that hold it.
  """
  holders: dict[int, list[int]] = {}
  paths = {}
  for i, b in enumerate(branches):
    for v in (b.weights if isinstance(b, keras.Model) else ()):
      holders.setdefault(id(v), []).append(i)
      paths[id(v)] = v.path
  for key, found in holders.items():
    if len(found) > 1:
      raise ValueError(
          f"weight {paths[key]!r} is shared by branches {found}; branches "
          "are placed apart and cannot share a weight. Give each branch its "
          "own layers, or train the model unsplit or with "
          "--strategy=model_parallel.")


def _branch_devices(branches: Sequence[BranchSpec],
                    devices: Sequence[str] | None) -> list[str]:
  """One resolved device per branch: `devices`, or the first accelerators.

  Raises:
    ValueError: no branches, more branches than devices, a `devices` of the
      wrong length, or an unknown device.
  """
  if not branches:
    raise ValueError("branches=[] is empty; give at least one sub-model.")
  if devices is None:
    found = devices_lib.accelerator_devices()
    if len(branches) > len(found):
      raise ValueError(
          f"{len(branches)} branches but only {len(found)} device(s) exist: "
          f"{', '.join(found)}. Pass devices=[...] (a device may hold "
          "several branches) or split a device with "
          "tfmgpu.configure_devices(logical_cpus=N) (CLI: "
          "--virtual_devices=N).")
    devices = found[:len(branches)]
  elif len(devices) != len(branches):
    raise ValueError(f"devices={list(devices)} has {len(devices)} entries "
                     f"for {len(branches)} branches; give one per branch.")
  return devices_lib.resolve_devices(devices)


class BranchParallel(placed_lib.PerDeviceGradientModel):
  """Sub-models on separate devices, same input, outputs combined.

  Example:

    towers = [make_tower, make_tower]             # callables or models
    model = tfmgpu.BranchParallel(towers, combine="mean",
                                  weights_paths=["a.weights.h5", None])
    model.compile(optimizer="adam", loss=...)
    model.fit(x, y)

  Attributes:
    branches: the sub-models, `branches[i]` on `branch_devices[i]`.
    branch_devices: the device of each branch.
    combine_device: where outputs are combined (and the loss computed).
  """

  def __init__(self, branches: Sequence[BranchSpec], *,
               devices: Sequence[str] | None = None,
               combine: str | keras.layers.Layer | Callable[[list], Any] = "concat",
               combine_device: str | None = None,
               weights_paths: Sequence[str | None] | None = None,
               name: str = "branch_parallel", **kwargs):
    """Places the branches and loads their weights.

    Args:
      branches: built Keras models (cloned onto their device, weights
        copied, unless already there) or callables returning one (called
        under the device, so variables are created there). All take the
        same input.
      devices: one device per branch (repeat a device to share it).
        Defaults to the first `len(branches)` accelerators.
      combine: `"concat"` (last axis), `"mean"`, `"sum"`, a Keras layer
        called on the list of outputs (built on `combine_device`), or a
        callable taking the list of outputs (`fn(outputs)`) or one
        argument per branch (`fn(pred1, pred2)`); a callable is traced on
        the branches' output shapes here, so a mistake shows at build time.
        Defaults to `"concat"`.
      combine_device: where outputs are combined. Defaults to `devices[0]`.
      weights_paths: one entry per branch: a weights file
        (`.weights.h5`) to load into it, or `None`.
      name: model name. Defaults to `"branch_parallel"`.
      **kwargs: passed to `keras.Model`.

    Raises:
      ValueError: no branches, more branches than devices, an unknown
        device or combine name, outputs that `combine` cannot join, or a
        `weights_paths` of the wrong length.
    """
    super().__init__(name=name, **kwargs)
    branches = list(branches)
    devices = _branch_devices(branches, devices)
    _check_not_shared(branches)
    placed = [_place(b, d, i) for i, (b, d) in enumerate(zip(branches, devices))]
    self.branch_devices = tuple(devices)
    self.combine_device = devices_lib.resolve_devices(
        [combine_device or devices[0]])[0]
    self.branches = placed
    self.record_source_policy(*placed)
    self._combine_fn, self.combiner = self._make_combine(combine, placed)
    if weights_paths is not None:
      if len(weights_paths) != len(placed):
        raise ValueError(
            f"weights_paths has {len(weights_paths)} entries for "
            f"{len(placed)} branches; give one per branch (None to skip).")
      for i, path in enumerate(weights_paths):
        if path is not None:
          self.load_branch_weights(i, path)
    self.built = True

  def _make_combine(self, combine, placed):
    specs, first = [], None
    for i, b in enumerate(placed):
      try:
        (spec_in,) = b.inputs
      except (AttributeError, ValueError, TypeError):
        raise ValueError(
            f"branches[{i}] ({b.name!r}) must have exactly one symbolic input "
            "(a Sequential or functional model built from a keras.Input)."
        ) from None
      shape = tuple(spec_in.shape)[1:]
      if first is not None and shape != first:
        raise ValueError(
            f"branches[{i}] takes inputs of shape {shape} but branches[0] "
            f"takes {first}; all branches get the same input.")
      first = shape
      specs.append(b.compute_output_spec(
          keras.KerasTensor(spec_in.shape, spec_in.dtype)))
    if isinstance(combine, str):
      if combine not in _COMBINE:
        raise ValueError(f"combine={combine!r} is unknown; use one of "
                         f"{', '.join(_COMBINE)}, a Keras layer or a callable.")
      out_shapes = [tuple(s.shape)[1:] for s in specs]
      if combine != "concat" and len(set(out_shapes)) > 1:
        raise ValueError(f"combine={combine!r} needs equal output shapes; the "
                         f"branches give {out_shapes}. Use combine='concat'.")
      return _COMBINE[combine], None
    if isinstance(combine, keras.layers.Layer):
      with tf.device(self.combine_device):  # Builds its variables there.
        combine(specs)
      return None, combine
    if callable(combine):
      return _checked_callable(combine, specs), None
    raise TypeError(f"combine={combine!r} is not a name, a Keras layer or a "
                    "callable.")

  def _combine(self, outputs, training):
    if self.combiner is not None:
      return self.combiner(outputs, training=training)
    return self._combine_fn(outputs)

  # ------------------------------------------------------------- weights

  def load_branch_weights(self, index: int, path: str) -> None:
    """Loads a weights file (saved from that sub-model) into branch `index`."""
    self._check_index(index)
    self.branches[index].load_weights(path)

  def _check_index(self, index: int) -> None:
    if not 0 <= index < len(self.branches):
      raise ValueError(f"index={index} is out of range: there are "
                       f"{len(self.branches)} branches (0..."
                       f"{len(self.branches) - 1}).")

  # ------------------------------------------------------- forward/backward

  def call(self, inputs, training=None):
    outputs = []
    for i, (b, device) in enumerate(zip(self.branches, self.branch_devices)):
      with tf.device(device), tf.name_scope(f"branch_{i}"):
        outputs.append(b(inputs, training=training))
    with tf.device(self.combine_device), tf.name_scope("combine"):
      return self._combine(outputs, training)

  def compute_loss_and_gradients(self, x, y, loss_fn: placed_lib.LossFn, *,
                                 scale_regularization=None):
    """Every branch forward and backward on its device; combine and loss on
    `combine_device`.

    Args:
      x: a batch of inputs (every branch gets all of it).
      y: its targets.
      loss_fn: `loss_fn(y_true, y_pred)` returns the scalar loss to
        differentiate, already averaged and scaled by the caller.
      scale_regularization: applied to each part's summed regularisation
        losses, e.g. `optimizer.scale_loss`. Defaults to the identity.

    Returns:
      `(loss, y_pred, grads)`, grads in the order of
      `self.trainable_variables`.
    """
    scale = scale_regularization or (lambda t: t)
    records, outputs = [], []
    for i, (b, device) in enumerate(zip(self.branches, self.branch_devices)):
      sources = [v.value for v in b.trainable_variables]
      with tf.device(device), tf.name_scope(f"branch_{i}"):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
          tape.watch(sources)
          out = b(x, training=True)
          reg = placed_lib.regularization_loss(b, scale)
      records.append((tape, out, reg, sources))
      outputs.append(out)
    combine_vars = (self.combiner.trainable_variables
                    if self.combiner is not None else [])
    sources = [v.value for v in combine_vars]
    with tf.device(self.combine_device), tf.name_scope("combine"):
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(sources)
        tape.watch(outputs)
        y_pred = self._combine(outputs, True)
        with tf.name_scope("loss"):
          objective = loss_fn(y, y_pred)
        if self.combiner is not None:
          reg = placed_lib.regularization_loss(self.combiner, scale)
          objective = objective if reg is None else objective + reg
    result = placed_lib.backward_on_device(
        tape, self.combine_device, "combine_backward", outputs=[],
        output_gradients=[], objective=objective, sources=sources + outputs)
    grads = {id(v): g for v, g in zip(combine_vars, result)}
    total = objective
    for i, (tape, out, reg, sources) in enumerate(records):
      upstream = result[len(combine_vars) + i]
      if upstream is None:
        upstream = tf.zeros_like(out)
      branch_grads = placed_lib.backward_on_device(
          tape, self.branch_devices[i], f"branch_{i}_backward",
          outputs=[out], output_gradients=[upstream], objective=reg,
          sources=sources)
      grads.update({id(v): g for v, g in
                    zip(self.branches[i].trainable_variables, branch_grads)})
      if reg is not None:
        total = total + reg
    return total, y_pred, [grads.get(id(v)) for v in self.trainable_variables]
