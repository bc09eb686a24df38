"""Batch splits: one replica's batch trained as row slices side by side.

With `batch_splits=k` each replica cuts its batch into `k` row slices and
builds each slice's forward and backward as its own branch of the step's
graph; the gradients are summed and applied once. Every slice's loss is
averaged over the whole global batch, so the sum is the gradient of the
unsplit batch (up to float rounding: a different order of additions).

Why: on a CPU, TensorFlow runs independent ops at once on its inter-op
threads, but one branch of a small model's ops leaves cores idle between
its many short ops; two branches keep them busy. The autotune decides by
measurement (`tfmgpu.training.autotune`), as for XLA. Under XLA
(`jit_compile=True`) each slice is its own compiled call, so the slices
still run side by side (gpt mini on 2 cores: 140 ms per step against 161
for one compiled step of the whole batch).

The equality holds only for models whose rows train independently, so
models with batch statistics (BatchNormalization) or with losses of their
own (regularizers, `add_loss`, counted once per slice) are refused, and
placed models (stages, pipelines, ZeRO) bring their own backward.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu.parallel import placed_model

GradsFn = Callable[..., tuple[Any, Any, list[Any]]]


def problem(model: keras.Model) -> str | None:
  """Why `model` cannot train in batch splits, or `None` if it can."""
  if placed_model.is_placed(model):
    return (f"{type(model).__name__} computes its own per-device backward "
            "(stages, pipelines, tensor or ZeRO splits)")
  norms = [l.name for l in _compat.flatten_layers(model)
           if isinstance(l, keras.layers.BatchNormalization)]
  if norms:
    return (f"its BatchNormalization layers ({', '.join(norms[:3])}) "
            "normalise each slice by its own statistics")
  if model.losses or any(getattr(l, "activity_regularizer", None)
                         for l in _compat.flatten_layers(model)):
    return ("it adds losses of its own (regularizers or add_loss), which "
            "each slice would count again")
  stateful = checks.stateful_layers(model)
  if stateful:
    return (f"its stateful RNN layers ({', '.join(stateful[:3])}) carry "
            "the state of the whole batch's rows, which a slice does not "
            "have")
  return None


def check(model: keras.Model, batch_splits: int) -> None:
  """Raises `ValueError` when `batch_splits` is not a positive int, or is
  above 1 for a model that `problem` refuses."""
  checks.check_positive("batch_splits", batch_splits)
  why = problem(model) if batch_splits > 1 else None
  if why:
    raise ValueError(f"batch_splits={batch_splits} cannot train model "
                     f"{model.name!r} exactly: {why}. Use batch_splits=1.")


def _rows(structure: Any, start: Any, stop: Any) -> Any:
  """Rows `start:stop` of every tensor of `structure` (`None` kept)."""
  return tf.nest.map_structure(
      lambda t: None if t is None else t[start:stop], structure)


def _add(a: Any, b: Any) -> Any:
  """The sum of two gradients of one variable (`IndexedSlices` stay
  sparse: their rows are concatenated)."""
  if a is None or b is None:
    return b if a is None else a
  if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
    return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                            tf.concat([a.indices, b.indices], 0),
                            a.dense_shape)
  return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def over_slices(grads_fn: GradsFn, model: keras.Model,
                batch_splits: int) -> GradsFn:
  """`grads_fn(x, y, sw, batch) -> (loss, y_pred, grads)` over
  `batch_splits` row slices of the batch, side by side.

  `grads_fn` must average its loss over the global batch (`batch` or a
  fixed size), so that the slices' losses and gradients add up to the
  whole batch's. Predictions are the slices' concatenated.
  """
  def split(x, y, sw=None, batch=None):
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    total, preds, grads = 0.0, [], None
    for i in range(batch_splits):
      start = rows * i // batch_splits
      stop = rows * (i + 1) // batch_splits
      loss, y_pred, part = grads_fn(_rows(x, start, stop),
                                    _rows(y, start, stop),
                                    _rows(sw, start, stop), batch)
      if model.losses:  # An add_loss that `problem` could not see.
        raise ValueError(
            f"batch_splits={batch_splits} cannot train model {model.name!r} "
            "exactly: it adds losses in its call (add_loss), which each "
            "slice would count again. Use batch_splits=1.")
      total += loss
      preds.append(y_pred)
      grads = part if grads is None else [_add(a, b)
                                          for a, b in zip(grads, part)]
    y_pred = tf.nest.map_structure(lambda *p: tf.concat(p, 0), *preds)
    return total, y_pred, grads

  return split
