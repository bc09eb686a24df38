"""Micro-batches: splitting a batch, and adding up their gradients and losses.

The helpers `PipelinedModel` uses to cut a step into `M` micro-batches and
make their sum equal the unsplit step: `split` cuts every tensor of a batch
(any structure) along its first axis (into near-equal parts when `M` does
not divide it: `part_sizes`, `part_divisors`) and `concat` joins the parts again
(with their Keras masks), `sum_gradients` adds one variable's gradients
(dense or `tf.IndexedSlices`), `call_losses` and `weight_regularization`
separate the losses a call adds (counted per micro-batch) from the weight
regularisers (counted once per step), and `counted_loss` says when a loss
divides by a count the parts of a batch do not share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat


def check_micro_batches(micro_batches: Any) -> int:
  """Returns `micro_batches` if it is an int >= 1.

  Raises:
    ValueError: anything else, with an example.
  """
  if (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
      or micro_batches < 1):
    raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1 "
                     "(e.g. micro_batches=4; 1 turns pipelining off).")
  return micro_batches


def split(structure: Any, num: int, *, uneven: bool = False) -> list[Any]:
  """Splits every tensor of a structure along axis 0 into `num` parts.

  Equal parts by default: a batch whose size is known only when it runs (a
  dataset's) is checked then, with an error that says what to do (a short
  last batch). With `uneven`, a batch of `n >= num` rows that `num` does not
  divide gives `n % num` parts one row longer than the rest (`part_sizes`).
  """
  flat = tf.nest.flatten(structure)
  if all(t is None for t in flat):  # No targets (a loss from add_loss).
    return [structure] * num
  if uneven and num > 1:
    sizes = part_sizes(structure, num)
    parts = [[None] * num if t is None else tf.split(t, sizes, num=num, axis=0)
             for t in flat]
    return [tf.nest.pack_sequence_as(structure, [p[m] for p in parts])
            for m in range(num)]
  dynamic = [t for t in flat if isinstance(t, tf.Tensor) and t.shape.rank
             and t.shape[0] is None]
  if dynamic and num > 1:
    with tf.control_dependencies([tf.debugging.assert_equal(
        tf.shape(dynamic[0])[0] % num, 0, message=(
            f"a batch must split into {num} equal parts (data-parallel "
            "replicas or copies), and this one's rows do not (a "
            "dataset's short last batch?): batch the dataset with "
            "drop_remainder=True, or use a batch size that every batch, the "
            "last included, divides."))]):
      flat = [None if t is None else tf.identity(t) for t in flat]
  parts = [[None] * num if t is None else tf.split(t, num, axis=0)
           for t in flat]
  return [tf.nest.pack_sequence_as(structure, [p[m] for p in parts])
          for m in range(num)]


def rows(structure: Any) -> Any:
  """The rows of a batch (its first tensor's): an int when the shape says
  it, else a scalar int32 tensor."""
  first = tf.convert_to_tensor(next(
      t for t in tf.nest.flatten(structure) if t is not None))
  return first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]


def near_equal(total: int, parts: int) -> list[int]:
  """`total` split into `parts` near-equal non-negative sizes: `total //
  parts`, plus one for the first `total % parts`."""
  return [total // parts + (m < total % parts) for m in range(parts)]


def part_sizes(structure: Any, num: int) -> Any:
  """The rows of each of `num` near-equal parts of a batch (`near_equal`).
  A list of ints when the batch size is known, else a `(num,)` int32
  tensor."""
  n = rows(structure)
  if isinstance(n, int):
    return near_equal(n, num)
  return n // num + tf.cast(tf.range(num) < n % num, tf.int32)


def part_divisors(structure: Any, num: int) -> list[Any]:
  """For each of `split(structure, num, uneven=True)`'s parts, the batch's
  rows over the part's: `num` itself for equal parts (so a per-row mean of
  the part divided by it is exactly its share of the batch's mean), else
  `n / n_m` (floats, or float tensors when the size is known only when it
  runs)."""
  n, sizes = rows(structure), part_sizes(structure, num)
  if isinstance(n, int):
    return [float(num) if n % num == 0 else n / size for size in sizes]
  n = tf.cast(n, tf.float32)
  return [n / tf.cast(sizes[m], tf.float32) for m in range(num)]


def divide(value: Any, divisor: Any) -> Any:
  """`value` over one of `part_divisors`' divisors, in `value`'s dtype (a
  float64 model's too): a part's share of a per-row mean."""
  if isinstance(divisor, (int, float)):
    return value / divisor
  return value / tf.cast(divisor, value.dtype)


def check_rows(structure: Any, num: int, rule: str) -> list[Any]:
  """Raises `ValueError(f"The batch of {n} examples {rule}")` for a batch
  known to have fewer than `num` rows; for one whose size is known only
  when it runs, returns the run-time check (its message: the rule, then
  `batch size:` and the size), to run before the batch is split."""
  size = rows(structure)
  if isinstance(size, int):
    if size < num:
      raise ValueError(f"The batch of {size} examples {rule}")
    return []
  if num == 1:
    return []
  return [tf.debugging.Assert(
      tf.greater_equal(size, num),
      [f"The batch (of the size that follows) {rule}", "batch size:", size])]


def concat(parts: Sequence[Any]) -> Any:
  """Joins micro-batch structures along axis 0 (the inverse of `split`).

  Keras masks on the parts (an output after `Embedding(mask_zero=True)`)
  are joined too: Keras' compiled loss and metrics skip masked entries.
  """
  def join(*ts):
    out = tf.concat(ts, axis=0)
    masks = [_compat.get_keras_mask(t) for t in ts]
    if all(m is not None for m in masks):
      _compat.set_keras_mask(out, tf.concat(masks, axis=0))
    return out
  return tf.nest.map_structure(join, *parts)


def carries_mask(structure: Any) -> bool:
  """Whether any tensor of a structure carries a Keras mask."""
  return any(_compat.get_keras_mask(t) is not None
             for t in tf.nest.flatten(structure))


def counted_loss(loss: Any) -> str | None:
  """Why a Keras `loss` (a `keras.losses.Loss`, or a dict / list of them as
  `compile` takes) divides by a count the batch's parts do not share, or
  `None`.

  Keras averages a loss with `ignore_class` over the targets not ignored,
  and one with `reduction="mean_with_sample_weight"` over the sum of the
  sample weights: the mean of such losses over parts of a batch (data
  copies, micro-batches, replicas) is not the whole batch's loss.
  """
  for item in tf.nest.flatten(loss):
    if not isinstance(item, keras.losses.Loss):
      continue
    ignored = item.get_config().get("ignore_class")
    if ignored is not None:
      return (f"loss {item.name!r} has ignore_class={ignored}, which Keras "
              "averages over the targets that are not ignored")
    if getattr(item, "reduction", None) == "mean_with_sample_weight":
      return (f"loss {item.name!r} has reduction='mean_with_sample_weight', "
              "which Keras divides by the sum of the sample weights")
  return None


def head(structure: Any, n: Any) -> Any:
  """The first `n` rows of every tensor of a structure (masks kept)."""
  def take(t):
    out, mask = t[:n], _compat.get_keras_mask(t)
    if mask is not None:
      _compat.set_keras_mask(out, mask[:n])
    return out
  return tf.nest.map_structure(take, structure)


def sum_gradients(grads: Sequence[Any]) -> Any:
  """Adds one variable's gradients from several micro-batches or uses.

  As TF's tape adds them: sparse parts only (an embedding's lookups) stay
  sparse, their rows concatenated; any dense part (a tied embedding's
  LM-head use) makes the sum dense. The form matters beyond the sum:
  Keras' Adam squares a sparse gradient's rows before they are added, so
  a dense use concatenated as rows would train a tied weight differently
  from one device.
  """
  grads = [g for g in grads if g is not None]
  if not grads:
    return None
  if len(grads) == 1:
    return grads[0]
  if all(isinstance(g, tf.IndexedSlices) for g in grads):
    return tf.IndexedSlices(tf.concat([s.values for s in grads], 0),
                            tf.concat([s.indices for s in grads], 0),
                            grads[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def sum_parts(grads: Sequence[Any]) -> Any:
  """Adds one variable's gradients from several micro-batches (or data
  copies) of one step: as `sum_gradients`, except that a lookup every row
  shares (positions `arange(length)`: its indices read no input, only
  constants and shapes) is summed row by row, as one device's single
  lookup gives one row per index. Concatenated, Keras' Adam squared each
  part's row before adding them (a pipeline of 4 micro-batches moved a
  position table 7.5e-4 off one device in 2 steps)."""
  grads = [g for g in grads if g is not None]
  if len(grads) > 1 and all(
      shared_lookup(g) and g.indices.shape == grads[0].indices.shape
      for g in grads):
    return tf.IndexedSlices(tf.add_n([g.values for g in grads]),
                            grads[0].indices, grads[0].dense_shape)
  if len(grads) > 1:
    say_mixed_lookups(grads[:1], "micro-batches or data copies")
  return sum_gradients(grads)


def shared_lookup(gradient: Any) -> bool:
  """Whether `gradient` is a traced lookup's that every row shares
  (`tf.IndexedSlices` whose indices, of a static shape, read no input:
  positions `arange(length)`). Parts of a batch then give one row per
  index each, to be summed row by row as one device's lookup is."""
  return (isinstance(gradient, tf.IndexedSlices)
          and gradient.indices.shape.is_fully_defined()
          and _reads_no_input(gradient.indices))


_SAID_MIXED: set[tuple[Any, str]] = set()


def say_mixed_lookups(grads: Sequence[Any], parts: str) -> None:
  """Warns (at trace time) when a sparse gradient joins a lookup every row
  shares with lookups of the data (one table for tokens and for
  `arange(length)`): its shared rows are joined per part, not summed, so
  Keras' Adam trains that table otherwise than one device (a trial: 3.3e-3
  on 2 replicas). `parts`: what the batch is split into."""
  for g in grads:
    op = getattr(getattr(g, "indices", None), "op", None)
    if not isinstance(g, tf.IndexedSlices) or op is None or (
        op.type != "ConcatV2"):
      continue
    shared = [_reads_no_input(t) for t in op.inputs[:-1]]
    static = tf.get_static_value(g.dense_shape)
    shape = (tuple(int(n) for n in static) if static is not None
             else ("?",) + tuple(g.values.shape[1:]))
    if any(shared) and not all(shared) and (shape, parts) not in _SAID_MIXED:
      _SAID_MIXED.add((shape, parts))
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning(
          "A table of shape %s is looked up both by the data and by indices "
          "every row shares (positions: arange(length)); over %s its shared "
          "rows are joined, not summed, so an optimizer that squares "
          "gradient rows (Adam) trains it otherwise than one device. Use "
          "separate tables for tokens and positions (as keras.io's "
          "TokenAndPositionEmbedding), or SGD.", shape, parts)
      return


# Ops whose values depend on an input's shape only.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _reads_no_input(tensor: Any, limit: int = 64) -> bool:
  """Whether a traced tensor's values come from constants and shapes alone
  (no function input, variable or data), within `limit` ops."""
  if tf.executing_eagerly() or not hasattr(tensor, "op"):
    return False
  seen, stack = set(), [tensor.op]
  while stack:
    op = stack.pop()
    if op.name in seen or op.type in _SHAPE_OPS:
      continue
    seen.add(op.name)
    if op.type == "Placeholder" or not op.inputs and op.type != "Const" or (
        len(seen) > limit):
      return False
    stack.extend(t.op for t in op.inputs)
  return True


def call_losses(stage: keras.Model) -> list[Any]:
  """The losses added by the stage's last call (activity regularisers etc.).

  `Layer.losses` lists those first and then recomputes one term per
  regularised weight; the weight terms are counted once per step elsewhere.
  """
  losses = stage.losses
  weighted = sum(1 for v in stage.trainable_weights
                 if getattr(v, "regularizer", None) is not None)
  return losses[:len(losses) - weighted]


_SAID_LOSSES: set[str] = set()


def loss_adders(model: keras.Model) -> list[str]:
  """The names of `model`'s layers whose last call added losses other than
  an activity regulariser's (those are per example)."""
  return [l.name for l in model.layers if call_losses(l)
          and getattr(l, "activity_regularizer", None) is None]


def say_call_losses(name: str, adders: Sequence[str], parts: str) -> None:
  """Warns once per `name` (at trace time) that the losses layers `adders`
  add in call() (`add_loss`) are computed on `parts` and averaged: exact
  for means over examples, not for a batch statistic."""
  if not adders or name in _SAID_LOSSES:
    return
  _SAID_LOSSES.add(name)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.warning(
      "%s: losses added in call() by layers %s are computed on %s and "
      "averaged. That equals the whole batch's loss when each is a mean "
      "over examples; a batch statistic (a mixture-of-experts "
      "load-balancing loss) trains differently from one device.", name,
      ", ".join(adders), parts)


def weight_regularization(stage: keras.Model) -> list[Any]:
  """One loss term per regularised trainable weight of `stage`."""
  return [v.regularizer(v) for v in stage.trainable_weights
          if getattr(v, "regularizer", None) is not None]
