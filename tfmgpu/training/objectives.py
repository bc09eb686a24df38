"""What training minimises and reports: losses and metrics, as Keras takes them.

`Objective` turns a Keras-style `loss` (a name, a `keras.losses.Loss`, a
function, or a dict/list of them per output, with `loss_weights`) and
`metrics` (names or `keras.metrics.Metric` objects, a list for every output
or a dict per output) into the two things a distributed step needs:

- `per_example_loss(y_true, y_pred, sample_weight)`: one loss per example
  (the weighted sum over outputs, each the mean over the example's own
  elements), which the step averages over the *global* batch. Averaged that
  way, the loss equals Keras' `"sum_over_batch_size"` loss of the whole
  batch, whatever the replica count.
- metric *states*: each metric's variables as plain tensors, updated
  statelessly (`Metric.stateless_update_state`). The step returns one
  step's change of every state; the distributed function sums the changes
  over replicas (SUM), the runner over calls and the coordinator over
  workers, and `results` computes each metric once from the summed state.
  Every Keras metric keeps sums and counts (its variables aggregate by
  SUM), so this is exact: never an average of averages, across replicas,
  micro-batches, stages or workers.

The default (`loss=None`) is sparse categorical cross-entropy *from
logits*, the loss of tfmgpu's demo models, with `"accuracy"`. Language
models also take `"bits_per_byte"` and `"perplexity"` by name (from logits;
`tfmgpu.training.text_metrics`). A loss given
by name follows Keras: `"sparse_categorical_crossentropy"` expects
probabilities (pass `keras.losses.SparseCategoricalCrossentropy(
from_logits=True)` for logits).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import microbatch
from tfmgpu.training import text_metrics

LossSpec = Any  # str | keras.losses.Loss | callable | dict | list | None
MetricSpec = Any  # str | keras.metrics.Metric | list | dict | None

_ACCURACY_NAMES = ("accuracy", "acc")


def default_loss(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
  """Sparse categorical cross-entropy from logits, per example (in the
  logits' dtype: `Objective` casts them to the loss's)."""
  return keras.losses.sparse_categorical_crossentropy(
      y_true, y_pred, from_logits=True)


def loss_function(loss: Any, *, what: str = "loss") -> Callable[..., Any]:
  """`fn(y_true, y_pred)` -> element-wise losses (unreduced), for one output.

  Args:
    loss: `None` (the default loss), a Keras loss name, a
      `keras.losses.Loss` (its reduction is bypassed) or a function
      returning per-example (or per-element) losses.
    what: the argument's name for errors.

  Raises:
    ValueError: `loss` is none of these.
  """
  if loss is None:
    return default_loss
  if isinstance(loss, keras.losses.Loss):
    _check_averaged(loss, what)
    return loss.call
  if isinstance(loss, str):
    try:
      fn = keras.losses.get(loss)
    except ValueError:
      fn = None
    if fn is None:
      raise ValueError(f"{what}={loss!r} is not a Keras loss name. Use e.g. "
                       "'mse', 'mae', 'binary_crossentropy', "
                       "'sparse_categorical_crossentropy', a keras.losses.Loss "
                       "or a function fn(y_true, y_pred).")
    return getattr(fn, "call", fn)
  if callable(loss):
    return _same_rank(loss)
  raise ValueError(f"{what}={loss!r} is not a loss name, a keras.losses.Loss "
                   "or a function fn(y_true, y_pred).")


def _same_rank(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` called as Keras' `compile` calls a loss function: its tensors'
  ranks made to agree first (`_compat.squeeze_or_expand_to_same_rank`).
  Called as given, (N,) labels against an (N, 1) output broadcast to (N, N)
  inside `fn`, and trained on every row against every other, silently (a
  new user's trial: test loss 4.39 where Keras' fit gives 3.49)."""
  @functools.wraps(fn)
  def call(y_true, y_pred, *args, **kwargs):
    if tf.is_tensor(y_true) and tf.is_tensor(y_pred):
      y_true, y_pred = _compat.squeeze_or_expand_to_same_rank(y_true, y_pred)
    return fn(y_true, y_pred, *args, **kwargs)
  return call


def _check_averaged(loss: keras.losses.Loss, what: str) -> None:
  """Refuses a Keras loss the step cannot reduce as Keras does: it averages
  every example's mean element loss over the global batch (Keras'
  `"sum_over_batch_size"`).

  Raises:
    ValueError: another reduction, or `ignore_class` (Keras divides by the
      targets not ignored, a count of the whole batch).
  """
  reduction = getattr(loss, "reduction", "sum_over_batch_size")
  if reduction not in ("sum_over_batch_size", "mean", None, "none"):
    raise ValueError(
        f"{what}={loss.name!r} has reduction={reduction!r}; tfmgpu's Trainer "
        "averages the loss over the global batch (Keras' default, "
        "'sum_over_batch_size'), whatever the number of replicas. Use the "
        "default reduction (scale the learning rate for 'sum').")
  reason = microbatch.counted_loss(loss)
  if reason:
    raise ValueError(
        f"{what}: {reason}, a count of the whole batch that tfmgpu's Trainer "
        "does not take (it averages every example's loss over the global "
        "batch). Drop ignore_class and pass sample_weight=0 for the targets "
        "to ignore (the loss is then averaged over all targets).")


def _loss_kind(loss: Any) -> str:
  """The Keras loss family of `loss`, to resolve `"accuracy"` like Keras."""
  if loss is None:
    return "sparse"
  name = loss if isinstance(loss, str) else getattr(
      loss, "name", getattr(loss, "__name__", ""))
  name = str(name).lower()
  if "sparse_categorical" in name:
    return "sparse"
  if "categorical" in name:
    return "categorical"
  if "binary" in name:
    return "binary"
  return "other"


def _from_logits(loss: Any) -> bool:
  """Whether `loss` reads logits: the default loss does, a Keras loss
  object says so (`from_logits`), and a Keras cross-entropy given by name
  reads probabilities, as in Keras."""
  if loss is None:
    return True
  if hasattr(loss, "from_logits"):
    return bool(loss.from_logits)
  if isinstance(loss, str) and "crossentropy" in loss.lower():
    return False
  return True


# TF's and Keras' words for labels and outputs whose shapes cannot meet
# (shape inference, kernels, Keras' sparse cross-entropy rank check).
_SHAPE_CLASH = ("Dimensions must be equal", "Incompatible shapes",
                "are incompatible", "must have rank (ndim)")


def _call_loss(out: _Output, y_true: Any, y_pred: Any) -> tf.Tensor:
  """`out.loss_fn(y_true, y_pred)`; labels it cannot compare with the
  output said as such (TF named a `Sub` node's shapes, a new user's
  `--loss=mse` on class indices against 10 logits).

  Raises:
    ValueError: the labels' and the output's shapes clash in the loss.
  """
  try:
    return out.loss_fn(y_true, y_pred)
  except (ValueError, tf.errors.InvalidArgumentError) as e:
    said = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    fn = out.loss_fn
    name = getattr(getattr(fn, "__self__", None), "name", None) or getattr(
        fn, "__name__", type(fn).__name__)
    sparse = fn is default_loss or "sparse" in str(name)
    shapes = [list(getattr(t, "shape", np.shape(t))) for t in (y_true, y_pred)]
    if ((shapes[0] == shapes[1] and not sparse)
        or not any(w in said for w in _SHAPE_CLASH)):
      raise  # Not the labels against the output: the loss's own error.
    name = ("the default loss (sparse categorical cross-entropy)"
            if fn is default_loss else f"loss {name!r}")
    raise ValueError(
        f"{name} cannot compare the labels of output {out.name!r}, shaped "
        f"{shapes[0]}, with the model's output, shaped {shapes[1]}. "
        f"{_shape_advice(shapes[0], shapes[1], sparse)} TF said: "
        f"{said[:300]}") from e


def _shape_advice(labels: list, output: list, sparse: bool) -> str:
  """What fits labels shaped `labels` to an output shaped `output` under a
  (`sparse`) cross-entropy or another loss."""
  label_rank, output_rank = len(labels), len(output)
  if sparse and labels[-1:] == output[-1:] and label_rank == output_rank:
    return ("Labels shaped like the output (one-hot rows) take "
            "categorical cross-entropy (--loss=categorical_crossentropy, "
            "or keras.losses.CategoricalCrossentropy(from_logits=True) for "
            "logits); the default loss takes one class index per example.")
  if sparse and label_rank + 2 == output_rank:
    return ("The model gives logits per position (a sequence model: gpt, "
            "llama, ...) and the data one label per example: train it on "
            "per-token labels (--dataset=stdlib_text), or use a model with "
            "one output per example for these labels (e.g. bert on "
            "stdlib_modules).")
  if sparse and label_rank == output_rank == 2:
    return ("The data gives a label per position (token data) and the model "
            "one output per example: train a sequence model on it (gpt, "
            "llama, ...), or give one label per example (e.g. "
            "stdlib_modules for bert).")
  return ("Class indices (one integer per example) take sparse categorical "
          "cross-entropy (the default loss, or --loss="
          "sparse_categorical_crossentropy) with one logit per class; 'mse' "
          "and 'mae' take targets shaped like the output (one value per "
          "output unit).")


def accuracy_by_shape(y_true: Any, y_pred: Any) -> tf.Tensor:
  """Keras' reading of "accuracy" from the shapes: one output unit is
  binary, targets shaped like the predictions are one-hot, and other
  targets are class indices."""
  y_true, y_pred = tf.convert_to_tensor(y_true), tf.convert_to_tensor(y_pred)
  if y_pred.shape[-1] == 1:
    return keras.metrics.binary_accuracy(y_true, y_pred)
  if (y_true.shape.rank == y_pred.shape.rank
      and y_true.shape[-1] == y_pred.shape[-1]):
    return keras.metrics.categorical_accuracy(y_true, y_pred)
  return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)


def _metric_object(metric: Any, loss: Any, what: str) -> keras.metrics.Metric:
  """A fresh Keras metric for `metric` (a name or a `Metric`)."""
  if isinstance(metric, keras.metrics.Metric):
    return metric
  if isinstance(metric, str) and metric.lower() in text_metrics.METRICS:
    return text_metrics.METRICS[metric.lower()](
        name=metric, from_logits=_from_logits(loss))
  if isinstance(metric, str) and metric.lower() in _ACCURACY_NAMES:
    kind = _loss_kind(loss)
    cls = {"sparse": keras.metrics.SparseCategoricalAccuracy,
           "categorical": keras.metrics.CategoricalAccuracy,
           "binary": keras.metrics.BinaryAccuracy}.get(kind)
    if cls is None:  # Decided from the shapes, as Keras does.
      return keras.metrics.MeanMetricWrapper(accuracy_by_shape, name=metric)
    return cls(name=metric)
  if isinstance(metric, str) or callable(metric):
    try:
      fn = keras.metrics.get(metric)
    except ValueError:
      fn = None
    if isinstance(fn, keras.metrics.Metric):
      return fn
    if fn is not None:
      name = metric if isinstance(metric, str) else fn.__name__
      return keras.metrics.MeanMetricWrapper(fn, name=name)
  raise ValueError(f"{what}={metric!r} is not a Keras metric name, a "
                   "keras.metrics.Metric or a function fn(y_true, y_pred). "
                   "Use e.g. 'accuracy', 'mae', keras.metrics.AUC().")


def _metric_label(metric: Any) -> str | None:
  """The reported name of a metric given by name: the name (as in Keras)."""
  return metric if isinstance(metric, str) else None


@dataclasses.dataclass
class _Output:
  """One model output: its name, position, loss and metrics.

  `weighted` holds the labels of the metrics that take sample weights
  (Keras' `weighted_metrics`); the others count every real row once.
  `loss_label` names the metric that averages this output's loss (a model
  with several outputs logs each one's, as Keras does).
  """
  name: str
  index: int
  loss_fn: Callable[..., Any] | None
  weight: float
  loss_dtype: str
  metrics: list[tuple[str, keras.metrics.Metric]]
  weighted: frozenset[str] = frozenset()
  loss_label: str | None = None


def _per_output(spec: Any, names: Sequence[str], what: str,
                alias: str | None = None) -> list[Any]:
  """`spec` given for all outputs, as a list, or as a dict: one per output.

  For a one-output model, as Keras: a dict keyed by its name (or `alias`,
  the name Keras gives it) and, for a loss or loss weight, a one-entry list.
  """
  if len(names) == 1:
    spec = _one_output_spec(spec, names[0], alias, what)
  if isinstance(spec, Mapping):
    unknown = sorted(set(spec) - set(names))
    if unknown:
      raise ValueError(f"{what} has keys {unknown} that are not outputs of "
                       f"the model; its outputs are {list(names)}.")
    return [spec.get(n) for n in names]
  if isinstance(spec, (list, tuple)) and len(names) > 1:
    if what in ("metrics", "weighted_metrics") and all(
        not isinstance(m, (list, tuple, Mapping)) for m in spec):
      return [list(spec)] * len(names)  # One list for every output.
    if len(spec) != len(names):
      raise ValueError(f"{what} has {len(spec)} entries for the model's "
                       f"{len(names)} outputs {list(names)}; give one per "
                       "output or a dict keyed by output name.")
    return list(spec)
  return [spec] * len(names)


def _one_output_spec(spec: Any, name: str, alias: str | None,
                     what: str) -> Any:
  """A one-output model's `spec` keyed by `name` if a dict keys it by
  `alias`; a one-entry list of a loss or loss weight, its entry."""
  if isinstance(spec, Mapping) and alias is not None and alias in spec:
    return {name if k == alias else k: v for k, v in spec.items()}
  if what in ("loss", "loss_weights") and isinstance(spec, (list, tuple)):
    if len(spec) != 1:
      raise ValueError(f"{what}={list(spec)!r} has {len(spec)} entries for "
                       "the model's one output; give one (or a dict keyed "
                       f"by the output's name, {alias or name!r}).")
    return spec[0]
  return spec


def _keras_output_name(model: keras.Model) -> str | None:
  """The name Keras keys a one-output model's loss and metric dicts by: the
  layer that makes its output (a Sequential's last layer)."""
  outputs = tf.nest.flatten(getattr(model, "outputs", None) or [])
  if len(outputs) != 1:
    return None
  try:
    return _compat.keras_history(outputs[0])[0].name
  except (AttributeError, TypeError, ValueError):
    return None


def output_names(model: keras.Model) -> list[str]:
  """The names of `model`'s outputs (`["output"]` when it has one); a
  staged or pipelined model answers for the model it was split from."""
  unsplit = getattr(model, "unsplit_output_names", None)
  if unsplit:
    return list(unsplit)
  try:
    output = model.output
  except (AttributeError, ValueError):  # Subclassed: no symbolic output.
    output = None
  if isinstance(output, Mapping) and len(output) > 1:
    # Dict outputs: keyed like y_pred, in the order of model.outputs (as
    # Keras: sorted, an OrderedDict's own), which a list of losses, loss
    # weights or labels follows.
    return graph_lib.dict_output_keys(
        output, tf.nest.flatten(getattr(model, "outputs", None) or []))
  outputs = getattr(model, "outputs", None)
  names = list(getattr(model, "output_names", None) or [])
  if outputs is not None and len(tf.nest.flatten(outputs)) > 1 and names:
    return names
  return names[:1] if len(names) == 1 else ["output"]


class Objective:
  """The losses and metrics of a training run (see the module docstring).

  Args:
    model: the Keras model (its output names key per-output dicts).
    loss: see `loss_function`; or a dict (by output name) / list (by
      position) of them for a model with several outputs.
    metrics: metric names or `Metric` objects: a list (for every output),
      or a dict by output name. `None` gives `["accuracy"]` with the default
      loss and no metric otherwise. As in Keras, they ignore sample weights.
    loss_weights: per-output weights of the total loss (dict or list).
    weighted_metrics: metrics, given as `metrics` is, that are weighted by
      the sample weights (Keras' `compile(weighted_metrics=...)`); one
      named like an unweighted metric is reported as `weighted_<name>`.

  Raises:
    ValueError: a loss or metric that is not one, or per-output specs that
      do not match the model's outputs.
  """

  def __init__(self, model: keras.Model, loss: LossSpec = None,
               metrics: MetricSpec = None, loss_weights: Any = None,
               weighted_metrics: MetricSpec = None):
    names = output_names(model)
    if metrics is None:
      metrics = ["accuracy"] if loss is None else []
    alias = _keras_output_name(model)
    losses = _per_output(loss, names, "loss", alias)
    weights = _per_output(loss_weights if loss_weights is not None else 1.0,
                          names, "loss_weights", alias)
    per_metrics = _per_output(metrics, names, "metrics", alias)
    per_weighted = _per_output(weighted_metrics, names, "weighted_metrics",
                               alias)
    multi = len(names) > 1
    self.outputs: list[_Output] = [
        _make_output(
            name, i, multi=multi, loss=losses[i],
            has_loss=not (isinstance(loss, (Mapping, list, tuple))
                          and losses[i] is None),
            weight=float(weights[i] if weights[i] is not None else 1.0),
            metrics=per_metrics[i], weighted_metrics=per_weighted[i])
        for i, name in enumerate(names)]
    self.loss_dtype = loss_dtype()  # Read once, as Keras' compile() does.
    self._check_unique_names()
    self._build_lazy_metrics(model)
    self._initial = {key: np.asarray(v) for key, v in self._variables()}
    self._check_scalar_results()

  def _check_unique_names(self) -> None:
    seen: set[str] = {"loss"}
    for out in self.outputs:
      for label, _ in out.metrics:
        if label in seen:
          raise ValueError(f"metrics: two metrics are named {label!r}; give "
                           "each metric object its own name=.")
        seen.add(label)

  def _build_lazy_metrics(self, model: keras.Model) -> None:
    """Metrics that make their state on first use (`F1Score`) get it now,
    from one update on zeros shaped like the output, then a reset."""
    shapes = graph_lib.output_shapes(model)  # A placed model's unsplit one's.
    for out in self.outputs:
      for label, metric in out.metrics:
        if metric.variables:
          continue
        if out.index >= len(shapes):
          raise ValueError(f"metrics: {label!r} makes its state on first use "
                           "and the model's output shape is unknown; use a "
                           "metric with fixed state or a functional model.")
        shape = [1 if d is None else d for d in shapes[out.index]]
        zeros = np.zeros(shape, np.float32)
        metric.update_state(zeros, zeros)
        metric.reset_state()

  def _check_scalar_results(self) -> None:
    """Each metric must give one number (a history entry, a log line)."""
    for value, (label, metric) in zip(
        self.results(self.zero_states(), scalars=False).values(),
        [m for o in self.outputs for m in o.metrics]):
      if np.size(value) != 1:
        kind = type(metric).__name__
        hint = (f"{kind}(average='micro', 'macro' or 'weighted')"
                if isinstance(metric, keras.metrics.FBetaScore)
                else "F1Score(average='macro'), Precision with one threshold")
        raise ValueError(
            f"metrics: {label!r} ({kind}) gives {np.shape(value)} values, "
            "not one number, which the logs need; configure it to give one "
            f"(e.g. {hint}).")

  def _variables(self):
    for out in self.outputs:
      for label, metric in out.metrics:
        for j, v in enumerate(metric.variables):
          yield f"metric/{label}/{j}", v

  # ------------------------------------------------------------- shapes

  @property
  def metric_names(self) -> list[str]:
    """The reported metric names, in order (after `"loss"`)."""
    return [label for out in self.outputs for label, _ in out.metrics]

  def state_shapes(self) -> dict[str, tuple[int, ...]]:
    """Each metric state tensor's key and shape (the step's extra sums)."""
    return {k: tuple(v.shape) for k, v in self._initial.items()}

  # ------------------------------------------------------------ in steps

  def _pairs(self, y_true: Any, y_pred: Any):
    """`(output, y_true_i, y_pred_i)` for each output, by name or position."""
    if len(self.outputs) == 1:
      yield self.outputs[0], _single(y_true), _single(y_pred)
      return
    for out in self.outputs:
      yield out, _pick(y_true, out, "y"), _pick(y_pred, out, "the model output")

  def per_example_loss(self, y_true: Any, y_pred: Any,
                       sample_weight: Any = None) -> tf.Tensor:
    """The weighted sum over outputs of each example's mean element loss."""
    total = None
    for out, yt, yp in self._pairs(y_true, y_pred):
      if out.loss_fn is not None:
        values = self._output_loss(out, yt, yp, sample_weight) * out.weight
        total = values if total is None else total + values
    if total is None:
      raise ValueError("loss: no output has a loss; give at least one.")
    return total

  def _output_loss(self, out: _Output, y_true: Any, y_pred: Any,
                   sample_weight: Any) -> tf.Tensor:
    """One output's loss per example: its sample weights applied, the mean
    over the example's elements (before the output's loss weight)."""
    if microbatch.carries_mask(y_pred):
      raise ValueError(
          f"the model's output {out.name!r} carries a Keras mask (e.g. from "
          "Embedding(mask_zero=True)), which Keras' fit uses to average the "
          "loss over the unmasked entries of the whole batch; tfmgpu's "
          "Trainer averages every example's loss over the global batch and "
          "would train on the masked entries. Pass the mask as sample_weight "
          "(0 on padding) from a model output without a Keras mask.")
    # In the loss's dtype, as Keras' Loss does (float64 for a float64 model).
    y_pred = _floats_as(tf.convert_to_tensor(y_pred), out.loss_dtype)
    y_true = tf.nest.map_structure(
        lambda t: _floats_as(t, out.loss_dtype), y_true)
    values = tf.cast(_call_loss(out, y_true, y_pred), self.loss_dtype)
    if values.shape.rank == 0:
      raise ValueError(
          f"loss for output {out.name!r} returned a scalar; it must return "
          "one loss per example (shape [batch] or [batch, ...]): reduce "
          "over the non-batch axes only.")
    sw = _pick_weight(sample_weight, out, len(self.outputs))
    if sw is not None:
      values = values * _broadcast_weight(tf.cast(sw, values.dtype), values)
    rank = len(values.shape)
    if rank > 1:
      values = tf.reduce_mean(values, axis=list(range(1, rank)))
    return values

  def metric_updates(self, y_true: Any, y_pred: Any,
                     sample_weight: Any = None,
                     mask: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
    """One batch's change of every metric state (keys of `state_shapes`).

    Weighted metrics take the sample weights, the others none, as in
    Keras; `mask` (1 for real rows, 0 for padding) multiplies either.
    """
    deltas: dict[str, tf.Tensor] = {}
    for out, yt, yp in self._pairs(y_true, y_pred):
      sw = _pick_weight(sample_weight, out, len(self.outputs))
      if mask is not None:
        sw = mask if sw is None else tf.cast(sw, tf.float32) * as_row_weight(
            mask, sw)
      for label, metric in out.metrics:
        keys = [f"metric/{label}/{j}" for j in range(len(metric.variables))]
        start = [tf.constant(self._initial[k]) for k in keys]
        if label == out.loss_label:  # The output's loss, averaged per row.
          new = metric.stateless_update_state(
              start, self._output_loss(out, yt, yp, sample_weight),
              sample_weight=mask)
        else:
          new = metric.stateless_update_state(
              start, yt, yp,
              sample_weight=sw if label in out.weighted else mask)
        for k, s, n in zip(keys, start, new):
          deltas[k] = tf.cast(n, tf.float32) - tf.cast(s, tf.float32)
    return deltas

  # ------------------------------------------------------------ on host

  def zero_states(self) -> dict[str, np.ndarray]:
    """Summed changes of nothing: the start of an epoch's accumulation."""
    return {k: np.zeros(v.shape, np.float32) for k, v in self._initial.items()}

  def results(self, deltas: Mapping[str, Any],
              scalars: bool = True) -> dict[str, Any]:
    """Each metric's value from its summed state changes (floats, unless
    `scalars=False`: as the metric computes them)."""
    out: dict[str, float] = {}
    for o in self.outputs:
      for label, metric in o.metrics:
        keys = [f"metric/{label}/{j}" for j in range(len(metric.variables))]
        state = [self._initial[k] + np.asarray(deltas.get(k, 0.0))
                 for k in keys]
        value = np.asarray(metric.stateless_result(state))
        # One number (an F1Score of one class gives it as a 1-vector).
        out[label] = float(value.reshape(())) if scalars else value
    return out


def _make_output(name: str, index: int, *, multi: bool, loss: Any,
                 has_loss: bool, weight: float, metrics: MetricSpec,
                 weighted_metrics: MetricSpec) -> _Output:
  """One output's loss and metrics, named as Keras logs them: prefixed by
  the output's name when the model has several, which also log each
  output's loss (`<name>_loss`, before its loss weight, as Keras)."""
  prefix = f"{name}_" if multi else ""
  plain = _labelled(metrics, loss, prefix, "metrics")
  taken = {label for label, _ in plain}
  weighted = [
      (label if label not in taken
       else f"{prefix}weighted_{label[len(prefix):]}", metric)
      for label, metric in _labelled(weighted_metrics, loss, prefix,
                                     "weighted_metrics")]
  loss_label = f"{name}_loss" if multi and has_loss else None
  own_loss = ([(loss_label, keras.metrics.Mean(name=loss_label))]
              if loss_label else [])
  return _Output(
      name=name, index=index,
      loss_fn=loss_function(loss, what="loss") if has_loss else None,
      weight=weight, loss_dtype=_own_dtype(loss),
      metrics=own_loss + plain + weighted,
      weighted=frozenset(label for label, _ in weighted),
      loss_label=loss_label)


def loss_dtype() -> str:
  """The dtype losses are summed in: Keras' `floatx()`, which its compiled
  loss casts every output's loss to (float32 under mixed precision, whose
  floatx stays float32; float64 for a float64 model). Added losses
  (regularisation) are cast to it too."""
  return keras.config.floatx()


def _own_dtype(loss: Any) -> str:
  """The dtype a loss computes in, as in Keras: a `keras.losses.Loss`'s
  own (`dtype=`, floatx by default), `loss_dtype()` for any other."""
  if isinstance(loss, keras.losses.Loss):
    return loss.dtype
  return loss_dtype()


def _labelled(wanted: MetricSpec, loss: Any, prefix: str, what: str
              ) -> list[tuple[str, keras.metrics.Metric]]:
  """One output's metrics as `(reported name, Metric)`, names prefixed by
  the output's when the model has several."""
  wanted = [] if wanted is None else (
      list(wanted) if isinstance(wanted, (list, tuple)) else [wanted])
  objs = [(_metric_label(m), _metric_object(m, loss, what)) for m in wanted]
  return [(prefix + (label or m.name), m) for label, m in objs]


def _floats_as(value: Any, dtype: str) -> Any:
  """`value` cast to `dtype` if it holds floats (labels stay integers)."""
  if value is None:
    return value
  value = tf.convert_to_tensor(value)
  return tf.cast(value, dtype) if value.dtype.is_floating else value


def _single(value: Any) -> Any:
  """The one tensor of a one-output structure (a 1-list, 1-dict or tensor)."""
  if isinstance(value, Mapping) and len(value) == 1:
    return next(iter(value.values()))
  if isinstance(value, (list, tuple)) and len(value) == 1:
    return value[0]
  return value


def _pick(value: Any, out: _Output, what: str) -> Any:
  if isinstance(value, Mapping):
    if out.name not in value:
      raise ValueError(f"{what} has no entry {out.name!r} for output "
                       f"{out.name!r}; its keys are {sorted(value)}.")
    return value[out.name]
  if isinstance(value, (list, tuple)):
    return value[out.index]
  raise ValueError(f"{what} is one tensor, but the model has several "
                   "outputs; give one per output (a list or a dict by "
                   "output name).")


def _pick_weight(sample_weight: Any, out: _Output, num_outputs: int) -> Any:
  if sample_weight is None or num_outputs == 1:
    return _single(sample_weight) if sample_weight is not None else None
  if isinstance(sample_weight, Mapping):
    return sample_weight.get(out.name)
  if isinstance(sample_weight, (list, tuple)):
    return sample_weight[out.index]
  return sample_weight  # One weight per example, for every output.


def _broadcast_weight(weight: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
  """Per-example weights `[batch]` (or `[batch, 1]`) against element losses
  `[batch, ...]`: trailing size-1 weight dims dropped, then expanded."""
  while len(weight.shape) > max(len(values.shape), 1) and weight.shape[-1] == 1:
    weight = tf.squeeze(weight, -1)
  extra = len(values.shape) - len(weight.shape)
  for _ in range(max(extra, 0)):
    weight = tf.expand_dims(weight, -1)
  return weight


def as_row_weight(mask: tf.Tensor, weight: Any) -> tf.Tensor:
  """The row mask `[batch]` shaped to multiply `weight` (`[batch, ...]`)."""
  return _broadcast_weight(tf.cast(mask, tf.float32), tf.convert_to_tensor(weight))
