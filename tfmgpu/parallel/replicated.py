"""Data parallelism over placed models: `R` replicas of a layout, one step.

`ReplicatedModel` holds `R` copies of a model that spreads itself over
devices (a `StagedModel`, `PipelinedModel` or `TensorParallelModel`), each
copy on its own devices. One training step:

1. splits the batch into `R` near-equal slices, one per copy (a short
   last batch too, each slice weighted by its rows);
2. runs each copy's forward and backward on its devices (its own
   `compute_loss_and_gradients`), with the loss still averaged over the
   *global* batch, so the sum of the copies' gradients is the gradient of
   the whole batch;
3. sums each variable's gradients over the `R` devices that hold a copy of
   it: a reduction per *group* of devices (the copies of one stage, or of
   one tensor shard), never one global all-reduce. The sums are spread over
   the group's devices (variable `i` is summed on copy `i mod R`'s device)
   and each copy reads its sum back: a reduce-scatter and an all-gather, the
   bytes of a ring all-reduce. Gradients travel in 16 bits if asked
   (`AllReduceOptions.compression`), and the summed gradient is clipped to
   a global norm computed over one copy (`clip_norm`), as in tfmgpu's
   data-parallel loop;
4. every copy applies the same summed gradient with its own optimizer slots,
   so the copies stay equal (what `MirroredStrategy` does, on devices that
   a `MirroredStrategy` replica cannot span).

From the outside it is one Keras model: `fit`, `predict` (the batch split
over the copies), weights to and from the unsplit model through the first
copy (`copy_weights_to`, `to_unsplit`) or into every copy (`load_from`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import checks
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import placed
from tfmgpu.parallel import placed_model
from tfmgpu.training import allreduce as allreduce_lib


def warn_unsynchronized_norms(model: keras.Model, copies: int,
                              name: str) -> None:
  """Says that training `BatchNormalization` layers normalise each of
  `copies` data-parallel copies' rows by their own statistics, so training
  differs from one device: plain ones as under `mirrored`, and
  `synchronized=True` ones too, as a placed model runs its copies itself
  (outside a strategy's replica context, where Keras would all-reduce
  their moments), unlike `mirrored`, where they are synced."""
  synced = checks.training_norms(model, synchronized=True)
  plain = checks.training_norms(model, synchronized=False)
  if copies > 1:
    checks.say_random_draws(name, model, f"for each of its {copies} "
                            "data-parallel copies' rows")
  if plain and copies > 1:
    logging.warning(
        "%s: BatchNormalization layers (%s) normalise each of its %d "
        "data-parallel copies' rows by their own statistics, as mirrored "
        "does, so training differs from one device.", name,
        checks.shown_names(plain), copies)
  if synced and copies > 1:
    logging.warning(
        "%s: BatchNormalization layers %s ask for synchronized=True, but "
        "each of its %d data-parallel copies normalises its own rows with "
        "their own statistics (they are not synchronized across its "
        "devices), so training differs from one device. For synchronized "
        "statistics train under --strategy=mirrored without --zero_stage "
        "or data copies (TF all-reduces them there).", name,
        checks.shown_names(synced), copies)


def _check_replicas(replicas: Sequence[Any]) -> list[Any]:
  replicas = list(replicas)
  if not replicas:
    raise ValueError("replicas=[] is empty; give at least one placed model.")
  for i, r in enumerate(replicas):
    if not hasattr(r, "compute_loss_and_gradients"):
      raise ValueError(
          f"replicas[{i}] ({type(r).__name__}) does not place its own work "
          "on devices. ReplicatedModel copies placed models (StagedModel, "
          "PipelinedModel, TensorParallelModel); for copies of a whole model "
          "on one device each use MirroredStrategy (--strategy=mirrored).")
  shapes = [[tuple(v.shape) for v in r.trainable_variables] for r in replicas]
  for i, s in enumerate(shapes[1:], 1):
    if s != shapes[0]:
      raise ValueError(
          f"replicas[{i}] has trainable variables of shapes {s[:4]}... but "
          f"replicas[0] has {shapes[0][:4]}...; every copy must be the same "
          "model split the same way.")
  return replicas


class ReplicatedModel(placed.PerDeviceGradientModel):
  """`R` copies of a placed model, trained as data-parallel replicas.

  Example (2 replicas of a 2-stage pipeline on 4 devices):

    copies = [tfmgpu.parallel.PipelinedModel(model, plan_r, micro_batches=4)
              for plan_r in plans]        # plan_r on devices 2r, 2r + 1
    dp = tfmgpu.parallel.ReplicatedModel(copies)
    dp.compile(optimizer="sgd", loss=...)
    dp.fit(x, y, batch_size=64)            # 32 rows per copy

  Attributes:
    replicas: the copies; `replicas[r]` holds slice `r` of each batch.
    data_parallel: `R`, the number of copies.
  """

  places_itself = True

  def __init__(self, replicas: Sequence[keras.Model], *,
               name: str | None = None, **kwargs):
    """Wraps the copies and makes every copy's weights equal the first's.

    Raises:
      ValueError: no copies, a copy that is not a placed model, or copies
        of different shapes.
    """
    replicas = _check_replicas(replicas)
    super().__init__(name=name or f"{replicas[0].name}_x{len(replicas)}",
                     **kwargs)
    self.replicas = replicas
    self.data_parallel = len(replicas)
    self.record_source_policy(replicas[0])
    warn_unsynchronized_norms(replicas[0], len(replicas), self.name)
    mine = [id(v) for v in self.trainable_variables]
    if mine != [id(v) for r in replicas for v in r.trainable_variables]:
      raise ValueError("ReplicatedModel: the copies' variables are not "
                       "tracked copy by copy; give each copy once.")
    first = [v.value for v in replicas[0].weights]
    for r in replicas[1:]:
      for v, w in zip(r.weights, first):
        v.assign(w)
      layer_state.finalize(r)  # An adapted Normalization's statistics.
    # The first copy's output names key per-output losses and metrics.
    self.unsplit_output_names = getattr(replicas[0], "unsplit_output_names",
                                        ())
    self.unsplit_output_shapes = graph_lib.output_shapes(replicas[0])
    self.unsplit_input_dtypes = graph_lib.input_dtypes(replicas[0])
    self.unsplit_input_keys = graph_lib.input_keys(replicas[0])
    self.built = True

  @property
  def devices(self) -> list[str]:
    """Every device a copy uses, copy by copy."""
    return [d for r in self.replicas for d in placed_devices(r)]

  # ------------------------------------------------------------- forward

  def _split(self, structure, checked) -> list[Any]:
    """`structure` (a batch, or its targets) in `R` near-equal parts, one
    per copy, after the run-time check of `checked` (the batch's inputs):
    a dataset's short last batch splits too, each part weighted by its rows
    (`microbatch.part_divisors`); one of fewer rows than `R` is refused."""
    r = self.data_parallel
    checks_ = microbatch.check_rows(checked, r, (
        f"has fewer rows than data_parallel={r} copies, so some copies "
        f"would get none. Use batches of at least {r} rows (with a "
        "dataset's short last batch: drop_remainder=True)."))
    with tf.control_dependencies(checks_):
      structure = tf.nest.map_structure(
          lambda t: None if t is None else tf.identity(t), structure)
    return microbatch.split(structure, r, uneven=True)

  def call(self, inputs, training=None):
    """Splits the batch over the copies (padding it outside training)."""
    r = self.data_parallel
    x = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    if training:
      parts = self._split(x, x)
      return microbatch.concat([m(p, training=True)
                                for m, p in zip(self.replicas, parts)])
    first = tf.nest.flatten(x)[0]
    n = tf.shape(first)[0]
    pad = (-n) % r
    x = tf.nest.map_structure(
        lambda t: tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)), x)
    parts = microbatch.split(x, r)
    out = microbatch.concat([m(p, training=False)
                             for m, p in zip(self.replicas, parts)])
    return tf.nest.map_structure(lambda t: t[:n], out)

  # ------------------------------------------------------------ training

  def compute_loss_and_gradients(self, x, y, loss_fn: placed.LossFn, *,
                                 scale_regularization=None,
                                 loss_reduction: str = "sum"):
    """Each copy's forward and backward on its slice; gradients not summed.

    Args:
      x, y: the whole batch, of at least `data_parallel` rows.
      loss_fn: `loss_fn(y_true, y_pred)`, as for the copies. `"sum"`: it
        divides by the global batch size (tfmgpu's Trainer), so the copies'
        losses add up; `"mean"`: it averages the rows it gets (Keras
        `fit`), so each copy's share is divided by `R`.
      scale_regularization: applied to each copy's regularisation, which
        is also divided by `R` (it is counted once per step, not per copy).

    Returns:
      `(loss, y_pred, grads)`: the summed objective, the copies' outputs in
      batch order, and each copy's own gradient per variable of
      `self.trainable_variables` (copy by copy); `reduce_gradients` sums
      them.
    """
    if loss_reduction not in ("sum", "mean"):
      raise ValueError(f"loss_reduction={loss_reduction!r} must be 'sum' or "
                       "'mean'.")
    r = self.data_parallel
    base = scale_regularization or (lambda t: t)
    xs, ys = self._split(x, x), self._split(y, x)
    divisors = microbatch.part_divisors(x, r)  # `R` for equal parts.
    totals, preds, grads = [], [], []
    for i, (model, xi, yi) in enumerate(zip(self.replicas, xs, ys)):
      d = divisors[i]
      share = loss_fn if loss_reduction == "sum" else (
          lambda y_true, y_pred, d=d: self._mean_share(loss_fn, y_true,
                                                       y_pred, d))
      with tf.name_scope(f"replica_{i}"):
        total, y_pred, g = model.compute_loss_and_gradients(
            xi, yi, share,
            scale_regularization=lambda t, d=d: microbatch.divide(base(t), d),
            **_inner_options(model, loss_reduction))
      totals.append(total)
      preds.append(y_pred)
      grads.extend(g)
    return tf.add_n(totals), microbatch.concat(preds), grads

  def _mean_share(self, loss_fn: placed.LossFn, y_true, y_pred, divisor):
    """A copy's share of a loss that averages the rows it gets: divided by
    `divisor`, the batch's rows over the copy's (`R` for equal parts).

    Raises:
      ValueError: the output carries a Keras mask (Keras averages the loss
        over each copy's own unmasked entries: their mean is not the
        batch's).
    """
    if self.data_parallel > 1 and microbatch.carries_mask(y_pred):
      raise ValueError(
          f"{self.name!r}: its {self.data_parallel} data-parallel copies "
          "average the losses of their slices, but the model's output "
          "carries a Keras mask (e.g. from Embedding(mask_zero=True)), so "
          "each copy's loss is a mean over its own unmasked entries and "
          "their mean differs from the whole batch's. Pass the mask as "
          "sample_weight instead (an output without a Keras mask), or use "
          "data=1.")
    return microbatch.divide(loss_fn(y_true, y_pred), divisor)

  def loss_parts(self) -> str | None:
    """`fit` averages the copies' losses (a copy may average its own)."""
    if self.data_parallel == 1:
      return None
    return (f"its {self.data_parallel} data-parallel copies average the "
            "losses of their slices")

  def _fit_loss_options(self) -> dict[str, Any]:
    """`fit`'s compiled loss averages the rows it gets: shares are `1/R`."""
    reduction = getattr(self.loss, "reduction", "sum_over_batch_size")
    if reduction in ("sum_over_batch_size", "mean"):
      return {"loss_reduction": "mean"}
    return {"loss_reduction": "sum"}

  def reduce_gradients(self, grads: Sequence[Any],
                       options: allreduce_lib.AllReduceOptions | None = None
                       ) -> list[Any]:
    """Sums each variable's gradients over its copies; clips; hands back.

    Args:
      grads: one gradient per variable of `self.trainable_variables` (copy
        by copy), as `compute_loss_and_gradients` returns them.
      options: compression and clipping, as for tfmgpu's data-parallel
        all-reduce (`bytes_per_pack` does not apply). Defaults to none.

    Returns:
      One gradient per variable: the sum over the copies, each on the
      device of its variable.
    """
    options = options or allreduce_lib.AllReduceOptions()
    r, n = self.data_parallel, len(grads) // self.data_parallel
    copies = [list(grads[i * n:(i + 1) * n]) for i in range(r)]
    owners = [[placed.variable_device(v) for v in m.trainable_variables]
              for m in self.replicas]
    summed = []
    for j in range(n):
      parts = [copies[i][j] for i in range(r)]
      if any(p is None for p in parts):
        summed.append(None)
        continue
      with tf.name_scope("group_all_reduce"):
        summed.append(sum_on_device(parts, [owners[i][j] for i in range(r)],
                           owners[j % r][j], options.compression))
    present = [g for g in summed if g is not None]
    if options.clip_norm is not None and present:
      it = iter(options.clip(present))  # In unscaled units.
      summed = [None if g is None else next(it) for g in summed]
    out = []
    for i in range(r):
      for j, g in enumerate(summed):
        if g is None:
          out.append(None)
          continue
        with tf.device(owners[i][j]):
          out.append(tf.identity(g) if not isinstance(g, tf.IndexedSlices)
                     else g)
    return out

  @property
  def source_model(self) -> keras.Model | None:
    """The model the copies were split from, while it lives."""
    return placed_model.source_of(self.replicas[0])

  def check_source_unchanged(self) -> None:
    """Raises when the model the copies were split from changed since
    (see `cloning.UnsplitWeights.check_source_unchanged`): the copies are
    of one model, so the first one's check is every one's."""
    check = getattr(self.replicas[0], "check_source_unchanged", None)
    if check is not None:
      check()

  # ---------------------------------------------------------------- weights

  def load_from(self, unsplit: keras.Model) -> None:
    """Copies the unsplit model's weights into every copy."""
    for model in self.replicas:
      model.load_from(unsplit)

  def copy_weights_to(self, unsplit: keras.Model) -> None:
    """Copies the (equal) weights of the first copy into an unsplit model."""
    self.replicas[0].copy_weights_to(unsplit)

  def to_unsplit(self, **kwargs) -> keras.Model:
    """The unsplit model holding the weights (see the copies' `to_unsplit`)."""
    return self.replicas[0].to_unsplit(**kwargs)

  def agree_copies(self) -> int:
    """Sets every copy's non-trainable weights to the first copy's.

    Each copy updates its BatchNorm moving statistics from its own slice of
    the batch, so after training they differ; `to_unsplit`, `model.save`
    and checkpoints give the first copy's, while `predict` and `evaluate`
    served each slice with its copy's own (0.05 off `to_unsplit()` in a
    trial). Training is unchanged: a copy's moving statistics never enter
    its gradients. Returns how many variables it set.
    """
    first = self.replicas[0].non_trainable_weights
    count = 0
    for replica in self.replicas[1:]:
      for mine, theirs in zip(replica.non_trainable_weights, first):
        if mine is not theirs:
          mine.assign(theirs.value)
          count += 1
    return count

  def weighted_layers(self) -> dict[str, Any]:
    """`{name: layer}`, each layer's weights in unsplit form: read from the
    first copy, written into every copy (the copies stay equal)."""
    copies = [m.weighted_layers() for m in self.replicas]
    return {name: _EveryCopy([c[name] for c in copies])
            for name in copies[0]}


class _EveryCopy:
  """One layer of every copy: weights read from the first, set in all."""

  def __init__(self, layers: Sequence[Any]):
    self.layers = list(layers)
    self.name = self.layers[0].name
    self.weights = self.layers[0].weights

  def get_weights(self) -> list[Any]:
    return self.layers[0].get_weights()

  def set_weights(self, weights: Sequence[Any]) -> None:
    for layer in self.layers:
      layer_state.set_weights(layer, weights)


def sum_on_device(parts: Sequence[Any], sources: Sequence[str], device: str,
         compression: str) -> Any:
  """One variable's copies' gradients summed on `device`.

  With `compression`, each part is cast on its own device (`sources`), so
  it travels in 16 bits; the sum is made in that dtype and cast back.
  """
  if any(isinstance(p, tf.IndexedSlices) for p in parts):
    with tf.device(device):
      return microbatch.sum_parts(parts)
  dtype = parts[0].dtype
  if compression != "none":
    cast = []
    for p, source in zip(parts, sources):
      with tf.device(source):
        cast.append(tf.cast(p, compression))
    parts = cast
  with tf.device(device):
    return tf.cast(tf.add_n(parts), dtype)


def _inner_options(model: Any, loss_reduction: str) -> dict[str, Any]:
  """Passes `loss_reduction` on to a copy that takes it (a pipeline)."""
  params = inspect.signature(model.compute_loss_and_gradients).parameters
  return {"loss_reduction": loss_reduction} if "loss_reduction" in params \
      else {}


def placed_devices(model: Any) -> list[str]:
  """The devices a placed model uses (stages', shards', copies')."""
  return list(getattr(model, "devices", None) or
              getattr(model, "stage_devices", None) or [])
