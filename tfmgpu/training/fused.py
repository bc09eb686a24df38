"""Fused optimizer updates: one TensorFlow kernel per variable.

A Keras 3 optimizer on TensorFlow writes each variable's update as a chain of
element-wise ops (Adam: about a dozen per variable, plus the step's scalar
math). On the small, frequent steps of data-parallel training the
executor's cost per op, paid once per variable per replica, outweighs the
arithmetic. TensorFlow ships fused kernels for the same math
(`ResourceApplyAdam`, `ResourceApplyKerasMomentum`,
`ResourceApplyGradientDescent`, the ones `tf.keras` 2 used); the classes
here are the Keras 3 optimizers with `update_step` replaced by one kernel
call. Hyper-parameters, slot variables, checkpoints and `get_config` are
those of the Keras class, so the two are interchangeable: tests train both
to the same weights (SGD bit for bit; Adam to float32 rounding, see
`_FusedAdamUpdate`). They work in `model.fit` too.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmgpu import _compat

_FUSED_DTYPES = (tf.float32, tf.float64)


def _handle(variable) -> tf.Tensor:
  """The resource handle of a Keras or TF variable (the local copy in an
  update of a mirrored variable)."""
  if isinstance(variable, keras.Variable):
    variable = variable.value
  return variable.handle


class _Fused:
  """Mixin: `update_step` through `_fused_update` where a kernel exists."""

  def _fusable(self, gradient, variable) -> bool:
    return (not isinstance(gradient, tf.IndexedSlices)
            and tf.as_dtype(variable.dtype) in _FUSED_DTYPES)

  def update_step(self, gradient, variable, learning_rate):
    if not self._fusable(gradient, variable):
      return super().update_step(  # pytype: disable=attribute-error
          gradient, variable, learning_rate)
    dtype = tf.as_dtype(variable.dtype)
    return self._fused_update(variable, tf.cast(gradient, dtype),
                              tf.cast(learning_rate, dtype), dtype)

  def _fused_update(self, variable, gradient, learning_rate, dtype):
    raise NotImplementedError


class _FusedAdamUpdate(_Fused):
  """Adam's update (as Keras 3 writes it) with one `ResourceApplyAdam`.

  The kernel computes `1 - beta` from a float32 `beta`: for `beta_1=0.9`
  that constant is 2.4e-7 (relative) from Keras's `1 - beta_1` rounded
  once to float32 (float32 rounding), but `1 - float32(0.999)` loses three
  digits to cancellation: 1.3e-5 from Keras's `1 - beta_2`. That error in
  each second-moment increment is far above float32 rounding, and a model
  that amplifies small differences (synchronized BatchNorm's moments, a
  difference of squares) turned it into 5e-5 after 4 steps. So the second
  moment is updated with Keras's own arithmetic, and the kernel is given
  `beta2=1` (its `1 - beta2` is then exactly 0: it leaves `v` as it is) and
  does the first moment and the variable's update in one pass.
  """

  def _fusable(self, gradient, variable) -> bool:
    return not self.amsgrad and super()._fusable(gradient, variable)

  def _fused_update(self, variable, gradient, learning_rate, dtype):
    momentum, velocity = _compat.adam_slots(self, variable)
    step = tf.cast(self.iterations + 1, dtype)
    beta_1 = tf.cast(self.beta_1, dtype)
    beta_2 = tf.cast(self.beta_2, dtype)
    # Keras's `v += (g^2 - v) * (1 - beta_2)`, to the bit.
    self.assign_add(velocity, tf.multiply(
        tf.subtract(tf.square(gradient), velocity), 1 - self.beta_2))
    return tf.raw_ops.ResourceApplyAdam(
        var=_handle(variable), m=_handle(momentum), v=_handle(velocity),
        beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
        lr=learning_rate, beta1=beta_1, beta2=tf.constant(1, dtype),
        epsilon=tf.cast(self.epsilon, dtype), grad=gradient)


@keras.saving.register_keras_serializable(package="tfmgpu")
class FusedAdam(_FusedAdamUpdate, keras.optimizers.Adam):
  """`keras.optimizers.Adam` whose update is one fused kernel per variable.

  Same arguments as `keras.optimizers.Adam`; `amsgrad=True` and sparse
  gradients fall back to the Keras update.
  """


@keras.saving.register_keras_serializable(package="tfmgpu")
class FusedAdamW(_FusedAdamUpdate, keras.optimizers.AdamW):
  """`keras.optimizers.AdamW` with the fused Adam update (weight decay is
  applied by Keras before it, as in `AdamW`)."""


@keras.saving.register_keras_serializable(package="tfmgpu")
class FusedSGD(_Fused, keras.optimizers.SGD):
  """`keras.optimizers.SGD` (plain, momentum or Nesterov) as one fused kernel
  per variable."""

  def _fused_update(self, variable, gradient, learning_rate, dtype):
    if self.momentum == 0:
      return tf.raw_ops.ResourceApplyGradientDescent(
          var=_handle(variable), alpha=learning_rate, delta=gradient)
    accumulator = self.momentums[_compat.variable_index(self, variable)]
    return tf.raw_ops.ResourceApplyKerasMomentum(
        var=_handle(variable), accum=_handle(accumulator), lr=learning_rate,
        grad=gradient, momentum=tf.cast(self.momentum, dtype),
        use_nesterov=self.nesterov)


# The Keras class each fused class stands in for (exact types: a user's
# subclass keeps its own update).
FUSED_CLASSES: dict[type, type] = {
    keras.optimizers.Adam: FusedAdam,
    keras.optimizers.AdamW: FusedAdamW,
    keras.optimizers.SGD: FusedSGD,
}


def fuse(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
  """The fused equivalent of an unbuilt Keras optimizer.

  Call it where the optimizer should live (in the strategy's scope): Keras
  optimizers bind to the current strategy when they are created.

  Args:
    optimizer: a Keras optimizer that has not created its slots yet.

  Returns:
    A new `FusedAdam`/`FusedAdamW`/`FusedSGD` with the same configuration,
    or `optimizer` itself when no fused kernel exists for its class (or it
    is already fused).

  Raises:
    ValueError: the optimizer is already built (its slots exist); fuse it
      before the first step.
  """
  fused_class = FUSED_CLASSES.get(type(optimizer))
  if fused_class is None:
    return optimizer
  if optimizer.built:
    raise ValueError(
        f"optimizer {optimizer.name!r} is already built; fuse it before it "
        "creates its slot variables (before the first step or `build`).")
  return _compat.copy_optimizer(optimizer, fused_class)
