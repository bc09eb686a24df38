"""The base of every placement: a model whose parts live on several devices.

`PerDeviceGradientModel` is what staged, pipelined and branch-parallel models
share: a `compute_loss_and_gradients` hook that runs each part's backward on
that part's device, the `train_step` that `fit` runs through that hook, and
a `compile` that builds the optimizer eagerly with each slot and each
per-variable update beside its variable. The helpers below are the pieces
the subclasses build their hook from: where a variable lives
(`variable_device`), colocated optimizer updates
(`colocate_optimizer_updates`), a part's regularisation
(`regularization_loss`), the tensors of a structure that carry gradients
(`differentiable`, `input_gradients`) and one device's vector-Jacobian
product (`backward_on_device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import placed_model
from tfmgpu.training import allreduce as allreduce_lib
from tfmgpu.training import optimizers as optimizers_lib
from tfmgpu.training import string_inputs

LossFn = Callable[[Any, Any], tf.Tensor]


def variable_device(variable) -> str:
  """The device a Keras or TF variable lives on."""
  if isinstance(variable, keras.Variable):
    variable = variable.value
  return variable.device


def colocate_optimizer_updates(optimizer: keras.optimizers.Optimizer):
  """Makes the optimizer run each variable's update on that variable's device.

  Keras 3 already creates slot variables next to their variable, but under
  the default strategy the update math (moments, bias correction) is traced
  without a device and would run on the default device. This wraps the
  optimizer's `update_step` (of the inner optimizer for a
  `LossScaleOptimizer`) in `tf.device(variable.device)`. Idempotent.

  Not covered: the shared step counter and learning-rate schedule (a few
  scalars on the default device) and decoupled weight decay.

  Args:
    optimizer: a Keras 3 optimizer.

  Returns:
    The same optimizer.
  """
  target = getattr(optimizer, "inner_optimizer", optimizer)
  if getattr(target, "_tfmgpu_colocated", False):
    return optimizer
  update_step = target.update_step

  def placed_update_step(gradient, variable, learning_rate):
    with tf.device(variable_device(variable)):
      return update_step(gradient, variable, learning_rate)

  target.update_step = placed_update_step
  target._tfmgpu_colocated = True  # pylint: disable=protected-access
  return optimizer


def regularization_loss(layer: keras.layers.Layer,
                        scale: Callable[[tf.Tensor], tf.Tensor]):
  """Sum of `layer.losses` (after its call) in Keras' `floatx()` (as its
  `compute_loss` sums them with the loss), scaled, or `None` if none."""
  losses = layer.losses
  if not losses:
    return None
  total = tf.add_n([tf.cast(tf.reduce_sum(l), keras.config.floatx())
                    for l in losses])
  return scale(total)


def differentiable(structure: Any) -> list[Any]:
  """The floating-point tensors of a structure, flat, in `tf.nest` order.

  These are what stages send gradients back for; integer tensors (token
  ids, masks) cross a stage boundary forward only.
  """
  return [t for t in tf.nest.flatten(structure)
          if t is not None and (t.dtype.is_floating or t.dtype.is_complex)]


def input_gradients(grads: Sequence[Any], inputs: Sequence[Any],
                    device: str) -> list[Any]:
  """`grads`, with zeros (made on `device`) where an input got `None`."""
  out = []
  for g, t in zip(grads, inputs):
    if g is None:  # The stage ignores this input.
      with tf.device(device):
        g = tf.zeros_like(t)
    out.append(g)
  return out


def backward_on_device(tape: tf.GradientTape, device: str, scope: str, *,
                       outputs: Sequence[tf.Tensor],
                       output_gradients: Sequence[tf.Tensor],
                       objective: tf.Tensor | None,
                       sources: Sequence[Any]) -> list[Any]:
  """One device's vector-Jacobian product, traced under that device.

  Differentiates `sum(<outputs[i], output_gradients[i]>) + objective` with
  respect to `sources`, with every gradient op on `device`.

  Returns:
    One gradient per source (`None` where a source is not connected).
  """
  if not sources or (not outputs and objective is None):
    return [None] * len(sources)
  with tf.device(device), tf.name_scope(scope):
    targets, seeds = list(outputs), list(output_gradients)
    if objective is not None:
      targets.append(objective)
      seeds.append(tf.ones_like(objective))
    return tape.gradient(targets, list(sources), output_gradients=seeds)


class PerDeviceGradientModel(keras.Model):
  """A Keras model whose parts live on different devices.

  Subclasses implement `compute_loss_and_gradients`, which computes each
  part's backward pass on its own device; `train_step` (what `fit` runs)
  uses it, so `fit` and a custom loop share one mechanism.

  Attributes:
    places_itself: `True`: the model routes its own work to its devices;
      callers (e.g. `tfmgpu.inference`) call it as is, outside any
      data-parallel strategy.
    source_dtype_policy: the dtype policy name of the model(s) it was made
      from (`record_source_policy`; `placed_model.dtype_policy_of` reads
      it), `None` until recorded.
    source_input_shape: the `input_shape` of the model(s) it was made from
      when they share one (`tfmgpu.inference` checks rows against it: a
      split model has none of its own), else `None`.
  """

  places_itself = True
  source_dtype_policy: str | None = None
  source_input_shape: Any = None

  def record_source_policy(self, *sources: keras.Model) -> None:
    """Records the dtype policy of the model(s) this one was made from, as
    Keras' `compile` of them would read it: `"mixed_float16"` when one of
    them computes in it (a `BranchParallel`'s branches), else the first's;
    and their input shape, when they share one. Subclasses call it when
    placed: the source may not outlive them."""
    names = [placed_model.dtype_policy_of(s) for s in sources]
    self.source_dtype_policy = ("mixed_float16" if "mixed_float16" in names
                                else next(iter(names), None))
    shapes = {repr(getattr(s, "input_shape", None)) for s in sources}
    if len(shapes) == 1:  # Also the input shape, for predict's check.
      self.source_input_shape = getattr(sources[0], "input_shape", None)

  def compute_loss_and_gradients(self, x, y, loss_fn: LossFn, *,
                                 scale_regularization=None):
    """Returns `(loss, y_pred, grads)`, each part's backward on its device.

    `grads` follow the order of `self.trainable_variables`; see the
    subclasses for the arguments.
    """
    raise NotImplementedError

  def compile(self, *args, jit_compile: bool | str = "auto", **kwargs):
    """`keras.Model.compile`, without XLA, with slots and updates on each
    variable's device, and the loss scaled (a `LossScaleOptimizer`) when
    the model it was made from computes in `mixed_float16`, as compiling
    that model would (unless `auto_scale_loss=False`).

    Raises:
      ValueError: `jit_compile=True`: XLA cannot compile one step whose
        variables live on several devices.
    """
    if jit_compile is True:
      raise ValueError(
          f"jit_compile=True is not supported by {type(self).__name__}: XLA "
          "cannot compile one step over variables on several devices. Use "
          "jit_compile=False (or 'auto').")
    check = getattr(self, "check_source_unchanged", None)
    if check is not None:  # Split models (`cloning.UnsplitWeights`).
      check()
    names = getattr(self, "unsplit_output_names", ())
    if names and not getattr(self, "output_names", None):
      # Keras keys a per-output loss or metric dict by `output_names`, which
      # only functional models have: without it a dict of losses for a
      # model returning a list fails inside `fit`.
      self.output_names = list(names)
    super().compile(*args, jit_compile=False, **kwargs)
    if kwargs.get("auto_scale_loss", True):
      # Keras reads this model's own policy (the global one when it was
      # placed); its source's, recorded, is what compiling it would read.
      self.optimizer = optimizers_lib.loss_scaled_for(self, self.optimizer)
    if self.optimizer is not None:
      # Build now, eagerly: built lazily inside the traced step, Keras would
      # create every slot on the default device instead of beside its variable.
      self.build_optimizer(self.optimizer)

  def fit(self, x: Any = None, *args, **kwargs) -> Any:
    """`keras.Model.fit`, strings the model does not take refused first
    (`tfmgpu.training.string_inputs`)."""
    string_inputs.check(self, x)
    return super().fit(x, *args, **kwargs)

  def evaluate(self, x: Any = None, *args, **kwargs) -> Any:
    """`keras.Model.evaluate`, strings refused first (as `fit`)."""
    string_inputs.check(self, x)
    return super().evaluate(x, *args, **kwargs)

  def predict(self, x: Any, *args, **kwargs) -> Any:
    """`keras.Model.predict`, strings refused first (as `fit`)."""
    string_inputs.check(self, x)
    return super().predict(x, *args, **kwargs)

  def save(self, filepath: Any, *args, **kwargs) -> Any:
    """Saves the unsplit model (`to_unsplit()`), which any layout, or
    none, loads: the placed parts do not save themselves (Keras raised a
    bare `NotImplementedError` from `get_config`).

    Raises:
      NotImplementedError: a placed model without an unsplit form.
    """
    unsplit = placed_model.unsplit_of(self)
    if unsplit is self:
      raise NotImplementedError(
          f"{type(self).__name__} {self.name!r} has no unsplit form to save; "
          "save the model it was placed from instead.")
    return unsplit.save(filepath, *args, **kwargs)

  def save_weights(self, filepath: Any, *args, **kwargs) -> Any:
    """Saves the unsplit model's weights (`to_unsplit()`): the file loads
    into the unsplit model and into any layout of it (`load_weights`), as
    Keras' `ModelCheckpoint(save_weights_only=True)` files then do. A
    placed model without an unsplit form saves its own."""
    unsplit = placed_model.unsplit_of(self)
    if unsplit is self:
      return super().save_weights(filepath, *args, **kwargs)
    return unsplit.save_weights(filepath, *args, **kwargs)

  def load_weights(self, filepath: Any, *args, **kwargs) -> Any:
    """Loads weights saved unsplit (by the unsplit model, or by any
    layout's `save_weights`) into this layout."""
    unsplit = placed_model.unsplit_of(self)
    if unsplit is self:
      return super().load_weights(filepath, *args, **kwargs)
    unsplit.load_weights(filepath, *args, **kwargs)
    self.load_from(unsplit)

  def build_optimizer(self, optimizer: keras.optimizers.Optimizer):
    """Prepares an optimizer for a custom loop over this model.

    Colocates its updates with the variables and builds its slots (each next
    to its variable); stateful Keras 3 optimizers need `build` before a
    `tf.function` step.

    Returns:
      The same optimizer.
    """
    optimizers_lib.check_splits(optimizer, self)
    optimizers_lib.check_exclusions(
        optimizer, self.trainable_variables,
        f"{type(self).__name__} {self.name!r}")
    colocate_optimizer_updates(optimizer)
    if not optimizer.built:
      optimizer.build(self.trainable_variables)
    return optimizer

  def _fit_loss_options(self) -> dict[str, Any]:
    """Extra keyword arguments `train_step` passes to the hook (none here)."""
    return {}

  def loss_parts(self) -> str | None:
    """How `fit` averages the compiled loss over parts of a batch (data
    copies, 1F1B's micro-batches), or `None`: one loss of the whole batch."""
    return None

  def _check_loss_parts(self) -> None:
    """Refuses a loss whose mean over the parts is not the batch's.

    Raises:
      ValueError: `loss_parts()` and a loss that divides by a count
        (`microbatch.counted_loss`): training would differ, silently.
    """
    parts = self.loss_parts()
    reason = microbatch.counted_loss(self.loss) if parts else None
    if reason:
      raise ValueError(
          f"{type(self).__name__} {self.name!r}: {parts}, but {reason}: "
          "their mean differs from the whole batch's loss. Give the loss the "
          "default reduction and weight the targets with sample_weight (0 "
          "for those to ignore), or train this model with a layout that "
          "computes the loss on the whole batch (model parallelism, "
          "schedule='gpipe', data=1).")

  def reduce_gradients(self, grads: Sequence[Any], options: Any = None
                       ) -> list[Any]:
    """Combines the hook's gradients before they are applied.

    Here: tfmgpu's all-reduce over the strategy's replicas (one, for a model
    that places itself), then clipping, as `options` (an
    `tfmgpu.training.allreduce.AllReduceOptions`) say; the identity without
    options. A model holding data-parallel copies of its parts
    (`tfmgpu.parallel.replicated.ReplicatedModel`) sums each variable's
    gradients over its copies instead.
    """
    if options is None:
      return list(grads)
    return allreduce_lib.all_reduce_gradients(grads, options)

  def train_step(self, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if _compat.compiled_loss(self) is None:
      raise ValueError(
          f"{type(self).__name__} has no loss to train on. Call "
          "compile(loss=...) before fit().")
    self._check_loss_parts()
    if not self.optimizer.built:
      raise ValueError(
          f"The optimizer of {type(self).__name__} is not built. Call "
          "compile() or build_optimizer(optimizer) before training: built "
          "inside the traced step, its slots would land on the default "
          "device.")
    scale = self.optimizer.scale_loss

    def loss_fn(targets, y_pred):
      # The compiled loss only: regularisation losses join each part's own
      # backward in compute_loss_and_gradients. The sample weights travel
      # with the targets, so a model that splits the batch splits them too.
      y_true, weights = targets
      return scale(_compat.compiled_loss(self)(y_true, y_pred, weights))

    loss, y_pred, grads = self.compute_loss_and_gradients(
        x, (y, sample_weight), loss_fn, scale_regularization=scale,
        **self._fit_loss_options())
    unscaled = loss / tf.cast(scale(tf.constant(1.0)), loss.dtype)
    batch = tf.shape(tf.nest.flatten(x)[0])[0]
    _compat.loss_tracker(self).update_state(
        _compat.unscale_loss_for_distribution(unscaled),
        sample_weight=batch)
    grads = self.reduce_gradients(grads)
    self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
