"""Gradient all-reduce owned by tfmgpu: correct clipping, compression, packing.

A Keras 3 optimizer all-reduces gradients inside `apply_gradients`, *after*
it clips them (`clipnorm`, `global_clipnorm`): under `MirroredStrategy` each
replica clips its own partial gradient, so the clip threshold no longer
means what it says. tfmgpu all-reduces first, then clips the summed
gradient, then lets the optimizer apply it with its own all-reduce turned
off. Owning the all-reduce also lets it compress gradients to 16 bits
(half the bytes on the wire) and choose pack sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import microbatch
from tfmgpu.training.choices import COMPRESSION_CHOICES


@dataclasses.dataclass(frozen=True)
class AllReduceOptions:
  """How replica gradients are summed.

  Attributes:
    compression: `"none"`, `"float16"` or `"bfloat16"`: the dtype gradients
      travel in (summed in that dtype, then cast back to float32).
    bytes_per_pack: pack small gradients into chunks of this many bytes
      (0: TF's default).
    clip_norm: clip the *summed* gradient to this global norm.
    loss_scale: `() -> the current loss scale` when the gradients are those
      of a scaled loss (a `LossScaleOptimizer`'s, see `for_optimizer`): the
      norm is then compared in the same units, so that the unscaled
      gradient is clipped to `clip_norm` as Keras' `global_clipnorm` does.
  """
  compression: str = "none"
  bytes_per_pack: int = 0
  clip_norm: float | None = None
  loss_scale: Callable[[], Any] | None = None

  def __post_init__(self):
    if self.compression not in COMPRESSION_CHOICES:
      raise ValueError(f"compression={self.compression!r} is unknown. Choose "
                       f"one of {', '.join(COMPRESSION_CHOICES)}.")
    if self.bytes_per_pack < 0:
      raise ValueError(f"bytes_per_pack={self.bytes_per_pack} must be >= 0.")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0 (or None).")


  def clip(self, values: list[Any]) -> list[Any]:
    """`values` (gradients, none `None`) clipped to `clip_norm` as one
    global norm, in unscaled units; as given without `clip_norm`."""
    if self.clip_norm is None or not values:
      return values
    limit = self.clip_norm
    if self.loss_scale is not None:
      limit = tf.cast(self.loss_scale(), tf.float32) * self.clip_norm
    clipped, _ = tf.clip_by_global_norm(values, limit)
    return clipped


def uses_loss_scaling(optimizer: keras.optimizers.Optimizer) -> bool:
  """Whether `optimizer` divides the gradients it applies by a loss scale
  (a `LossScaleOptimizer`, or any optimizer's `loss_scale_factor`, which
  Keras' `apply` divides out): the loss is then scaled up by as much."""
  return (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
          or getattr(optimizer, "loss_scale_factor", None) is not None)


def for_optimizer(options: AllReduceOptions | None,
                  optimizer: keras.optimizers.Optimizer
                  ) -> AllReduceOptions | None:
  """`options` for the gradients `optimizer` is given: with its loss scale
  when it is a `LossScaleOptimizer` or has a `loss_scale_factor` (they are
  then scaled until it applies them)."""
  if options is None or not uses_loss_scaling(optimizer):
    return options
  return dataclasses.replace(
      options, loss_scale=lambda: optimizer.scale_loss(tf.constant(1.0)))


def _no_all_reduce(grads_and_vars):
  return list(grads_and_vars)


def take_over_aggregation(optimizer: keras.optimizers.Optimizer,
                          options: AllReduceOptions | None = None
                          ) -> AllReduceOptions | None:
  """Turns off the optimizer's own all-reduce (tfmgpu does it before).

  Patches the instance and every optimizer it wraps (a
  `LossScaleOptimizer`'s inner one, a `MultiOptimizer`'s), not the class,
  so other optimizers in the process are untouched. (A wrapped optimizer
  left alone all-reduced its gradients once more: a `MultiOptimizer` on 2
  replicas took twice the step.)

  Returns:
    `options` for the gradients `optimizer` is then given
    (`for_optimizer`: with its loss scale, if it has one).
  """
  for opt in _compat.each_optimizer(optimizer):
    _compat.replace_gradient_all_reduce(opt, _no_all_reduce)
  return for_optimizer(options, optimizer)


def all_reduce_gradients(grads: Sequence[tf.Tensor | None],
                         options: AllReduceOptions) -> list[tf.Tensor | None]:
  """Sums gradients over replicas (call in replica context), then clips.

  Returns:
    The summed (and clipped) gradients, same order, `None`s kept.
  """
  ctx = tf.distribute.get_replica_context()
  present = [i for i, g in enumerate(grads) if g is not None]
  # A lookup every row shares (positions): its rows are summed, not
  # concatenated as TF joins sparse gradients (Keras' Adam would square
  # each replica's row before adding them; one device has one row).
  shared = {i for i in present if microbatch.shared_lookup(grads[i])}
  if ctx is not None and ctx.num_replicas_in_sync > 1:
    microbatch.say_mixed_lookups(
        [grads[i] for i in present if i not in shared], "replicas")
  values = [grads[i].values if i in shared else grads[i] for i in present]
  if ctx is not None and values:
    dtypes = [g.dtype for g in values]
    if options.compression != "none":
      values = [tf.cast(g, options.compression) for g in values]
    hints = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack)
    values = ctx.all_reduce(tf.distribute.ReduceOp.SUM, values, options=hints)
    values = [tf.cast(g, d) for g, d in zip(values, dtypes)]
  values = options.clip(values)
  out = list(grads)
  for i, g in zip(present, values):
    out[i] = (tf.IndexedSlices(g, grads[i].indices, grads[i].dense_shape)
              if i in shared else g)
  return out


def all_reduced_bytes(variables, compression: str = "none") -> int:
  """Bytes one replica sends into the all-reduce per step."""
  size = 4 if compression == "none" else 2
  return sum(int(tf.size(v)) for v in variables) * size
