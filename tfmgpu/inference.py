"""Multi-device inference: one `predict` for every placement.

* Data parallel (`default`, `one_device`, `mirrored`, ...): the batch is
  split across replicas; the last partial batch is padded and trimmed, never
  dropped, so every input row gets exactly one output row, in input order.
* Placements (staged, pipelined, branch-parallel models) place themselves:
  they are called batch by batch and route work to their own devices.

Several batches run per `tf.function` call (`steps_per_execution`), inputs
are prefetched by the strategy's distributed dataset (to the device where
the platform supports it), and `precision="bfloat16"` / `"float16"`
computes in reduced precision with float32 outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import warnings
import weakref
import zipfile
from collections.abc import Mapping
from typing import Any, Callable

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu import files
from tfmgpu import models as models_lib
from tfmgpu import rundir
from tfmgpu import strategies as strategies_lib
from tfmgpu import user_code
from tfmgpu.parallel import cloning
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import placed_model
from tfmgpu.strategies import collective_keys
from tfmgpu.training import replica_state
from tfmgpu.training import distributed
from tfmgpu.training import inputs as inputs_lib
from tfmgpu.training import model_checks
from tfmgpu.training import progress as progress_lib
from tfmgpu.training import resident
from tfmgpu.training import string_inputs

PRECISIONS = ("float32", "bfloat16", "float16")


def check_input_shape(model: Any, x: np.ndarray) -> None:
  """Raises a clear error when rows of `x` do not fit the model's input
  (a placed model's: its source's, `source_input_shape`)."""
  expected = getattr(model, "source_input_shape", None) or getattr(
      model, "input_shape", None)
  if not isinstance(expected, tuple):  # None, or one per input.
    return
  want = tuple(expected[1:])
  got = tuple(x.shape[1:])
  if len(want) != len(got) or any(w is not None and w != g
                                  for w, g in zip(want, got)):
    raise ValueError(
        f"data rows have shape {got} but model {getattr(model, 'name', '')!r} "
        f"expects {want} (input_shape={tuple(expected)}). Reshape the data "
        "or pick the dataset the model was trained on.")


def check_input_keys(model: Any, x: Mapping[str, Any]) -> None:
  """Raises a clear error when dict `x` lacks an input the model takes
  by name (Keras' own error came from inside the traced step, 12 lines
  deep; keys the model does not take are ignored, as in Keras)."""
  wanted = graph_lib.input_keys(model)
  missing = [k for k in wanted or () if k not in x]
  if missing:
    raise ValueError(
        f"x is missing input(s) {', '.join(map(repr, missing))} of model "
        f"{getattr(model, 'name', '')!r}: x has keys {sorted(x)}, the model "
        f"takes {sorted(wanted)}. Give x one array per input name.")


def _resolve_strategy(model, strategy) -> tf.distribute.Strategy:
  if isinstance(strategy, str):
    return strategies_lib.get_strategy(strategy)
  if strategy is not None:
    return strategy
  return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


def _on_the_coordinator() -> tf.distribute.Strategy:
  """The strategy a parameter-server model predicts under: none (TF's
  default). Its workers run only functions the coordinator schedules and
  read only per-worker datasets, so the coordinator runs each batch itself,
  reading the variables from the servers, as the Trainer's evaluation does.

  Raises:
    ValueError: called inside a strategy's scope, whose strategy would
      then run the batches.
  """
  if tf.distribute.has_strategy():
    raise ValueError(
        "predict on a model built under a ParameterServerStrategy runs on "
        "the coordinator, outside any strategy's scope; it was called inside "
        f"the scope of {type(tf.distribute.get_strategy()).__name__}. Call "
        "tfmgpu.predict after the `with strategy.scope():` block.")
  return tf.distribute.get_strategy()


def _prepare_model(model, strategy, precision: str):
  """The model to run: cast to `precision`, and replicated under `strategy`
  (a parameter-server model runs on the coordinator: `_on_the_coordinator`)."""
  if precision not in PRECISIONS:
    raise ValueError(f"precision={precision!r} is unknown. Choose one of "
                     f"{', '.join(PRECISIONS)}.")
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    strategy = _on_the_coordinator()
    if precision == "float32" and not isinstance(model, SavedModelPredictor):
      return model, strategy
  if isinstance(model, SavedModelPredictor):
    if precision != "float32":
      raise ValueError(f"precision={precision!r} needs a Keras model to "
                       f"cast; {model.path!r} is a SavedModel. Use "
                       "precision='float32' or its .keras file.")
    return model.under(strategy), strategy
  if placed_model.is_placed(model):
    if precision != "float32":
      raise ValueError(f"precision={precision!r} is not supported for placed "
                       f"model {model.name!r}; use precision='float32'.")
    return model, tf.distribute.get_strategy()
  needs_clone = (precision != "float32"
                 or not cloning.built_in_scope(model, strategy))
  if not needs_clone:
    return model, strategy
  dtype = None if precision == "float32" else precision
  return cloning.copy_model(model, strategy, dtype=dtype), strategy


class Predictor:
  """Compiled multi-device prediction for one model and placement.

  Holds the (possibly replicated or reduced-precision) copy of the model and
  its compiled `tf.function`, so repeated calls do not retrace. `predict()`
  keeps one per model and options.

  Args:
    model: a Keras model, or a staged / pipelined / branch-parallel model;
      or the path of a `.keras` file or SavedModel, loaded here
      (`load_model`).
    strategy: a `tf.distribute.Strategy` or registered name; defaults to the
      strategy the model was built under. Ignored for placed models.
    batch_size: global batch per step; rounded up to a multiple of the
      replica count. Defaults to `1024` (large batches amortise overhead).
    steps_per_execution: batches per `tf.function` call. Defaults to `4`.
    precision: `float32`, `bfloat16` or `float16` compute; floating outputs
      are always float32 (integer outputs keep their dtype).
    prefetch: read the next batches (to each device, where the platform
      supports it) while the current one computes. Defaults to `True`.

  Inputs of at most `batch_size` rows (online serving) skip the input
  pipeline on one host (one device, mirrored, placements): they are split
  over the replicas and run in one call, so a request's latency is one
  step's. Multi-worker, central-storage and TPU strategies always read
  through `tf.data`. A model built under a parameter-server strategy
  predicts on the coordinator, which reads its variables from the servers
  (call it outside the strategy's scope).
  """

  def __init__(self, model: Any, *, strategy: Any = None,
               batch_size: int = 1024, steps_per_execution: int = 4,
               precision: str = "float32", prefetch: bool = True):
    for name, value in (("batch_size", batch_size),
                        ("steps_per_execution", steps_per_execution)):
      if value < 1:  # Each named alone (a user's batch_size=0 named both).
        raise ValueError(f"{name}={value!r} must be >= 1.")
    if not isinstance(prefetch, bool):
      raise ValueError(f"prefetch={prefetch!r} must be True or False.")
    self.prefetch = prefetch
    if isinstance(model, (str, os.PathLike)):
      model = load_model(os.fspath(model))
    self.model = model
    self.runner, self.strategy = _prepare_model(
        model, _resolve_strategy(model, strategy), precision)
    model_checks.refuse_stateful_replicas(model, self.strategy)
    if self.runner is model:  # A copy took the first replica's values.
      replica_state.agree(model)
    self._handles = _handles(self.runner)
    collective_keys.share(self.strategy)
    replicas = self.strategy.num_replicas_in_sync
    self.batch_size = -(-batch_size // replicas) * replicas
    self.steps_per_execution = steps_per_execution
    self._fn = _predict_function(self.runner, self.strategy)
    self._fn_one = self._fn.one

  def refresh(self) -> None:
    """Copies the model's current weights into the copy this predictor
    serves (made for another strategy's scope or precision); when it
    serves the model itself, sets each replica's BatchNorm statistics to
    the first replica's (`replica_state.agree`). `tfmgpu.predict` does it
    before every call, so a model trained on since predicts with its latest
    weights, on every replica as it saves."""
    if self.runner is not self.model and isinstance(self.model, keras.Model):
      layer_state.set_weights(self.runner, self.model.get_weights())
      return
    replica_state.agree(self.runner)
    if _handles(self.runner) != self._handles:  # ZeRO moved its variables:
      self._fn = _predict_function(self.runner, self.strategy)  # the traced
      self._fn_one = self._fn.one  # function read the old ones.
      self._handles = _handles(self.runner)

  def predict(self, x: Any, *, output_kind: str = "logits",
              verbose: int | str = 0) -> Any:
    """Predictions for every row of `x`, in input order (numpy).

    Args:
      x: an array, a `tf.RaggedTensor` or `tf.SparseTensor`, a
        dict/list/tuple of them (a model with several inputs), or a
        `tf.data.Dataset` of input batches (`x`, or `(x, y)` /
        `(x, y, sample_weight)` whose targets are ignored, as in Keras).
      output_kind: `logits` (the model's outputs), `probabilities` or
        `classes` (see `convert_outputs`). Defaults to `logits`.
      verbose: as Keras': `0` silent, `1` or `"auto"` a progress line of
        rows done (rewritten in place on a terminal, printed once at the
        end elsewhere, as `Trainer`'s), `2` that line once at the end.
        Defaults to `0` (Keras' `"auto"` prints).

    Returns:
      One array with a row per input row (float32; int32 classes), or a
      list/dict of them for a model with several outputs.

    Raises:
      ValueError, TypeError: inputs that are not arrays or a dataset, rows
        that do not fit the model's input, or an unknown `output_kind`.
    """
    checks.check_choice("output_kind", output_kind, OUTPUT_KINDS)
    checks.check_choice("verbose", verbose, VERBOSE)
    return convert_outputs(self._predict(x, verbose), output_kind)

  def _predict(self, x: Any, verbose: int | str = 0) -> Any:
    """The model's float32 outputs for every row of `x`, in input order."""
    string_inputs.check(self.model, x)
    if isinstance(x, tf.data.Dataset):
      return self._predict_dataset(x, verbose=verbose)
    if _has_composite(x):  # Ragged or sparse rows: tf.data slices them.
      n, padded = _padded_composite(
          x, self.strategy.num_replicas_in_sync)
      return self._predict_dataset(tf.data.Dataset.from_tensor_slices(
          padded).batch(self.batch_size), n, verbose)
    source = inputs_lib.from_user(x, what="x", needs_targets=False)
    if not isinstance(source, inputs_lib.ArrayData):
      raise TypeError("x is a dataset function; predict takes arrays (any "
                      "nesting) or a tf.data.Dataset of input batches.")
    x = source.x
    if hasattr(self.model, "check_inputs"):
      self.model.check_inputs(x)
    if isinstance(x, dict):
      check_input_keys(self.model, x)
    elif not isinstance(x, tuple):
      check_input_shape(self.model, x)
    n = len(tf.nest.flatten(x)[0])
    if n == 0:  # One zero row gives every output's structure, shape, dtype.
      one = tf.nest.map_structure(lambda a: inputs_lib.pad_rows(a, 1), x)
      return tf.nest.map_structure(lambda a: a[:0], self._predict(one))
    replicas = self.strategy.num_replicas_in_sync
    # No bigger than needed, so small inputs are not padded to a huge batch.
    batch = min(self.batch_size, -(-n // replicas) * replicas)
    if n <= batch and resident.supports(self.strategy):
      return self._predict_one_batch(x, n, batch, verbose)
    steps = -(-n // batch)
    dataset = _streamed_batches(x, batch)
    options = None
    if self.prefetch:
      dataset = dataset.prefetch(2)
    else:
      options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    iterator = iter(self.strategy.experimental_distribute_dataset(
        dataset, options=options))
    out, done = _Rows(n, verbose), 0
    while done < steps:
      k = min(self.steps_per_execution, steps - done)
      out.add(self._fn(iterator, tf.constant(k)))
      done += k
    return out.result()

  def _predict_one_batch(self, x: Any, n: int, batch: int,
                         verbose: int | str) -> Any:
    """One call on `x` padded to `batch` rows, split over the replicas."""
    padded = tf.nest.map_structure(lambda a: inputs_lib.pad_rows(a, batch), x)
    rows = batch // self.strategy.num_replicas_in_sync
    inputs = resident.on_each_device(  # Each slice copied once, to its replica.
        self.strategy, lambda r: tf.nest.map_structure(
            lambda a: a[r * rows:(r + 1) * rows], padded))
    out = _Rows(n, verbose)
    out.add(self._fn_one(inputs))
    return out.result()

  def _predict_dataset(self, dataset: tf.data.Dataset, n: int | None = None,
                       verbose: int | str = 0) -> Any:
    """Batch by batch over a dataset (the last batch may be short); only
    its first `n` rows if given."""
    spec = dataset.element_spec
    if isinstance(spec, tuple) and 1 <= len(spec) <= 3:
      dataset = dataset.map(lambda *parts: parts[0])
    if isinstance(dataset.element_spec, dict):
      check_input_keys(self.model, dataset.element_spec)
    out = _Rows(n, verbose)
    for batch in self.strategy.experimental_distribute_dataset(dataset):
      out.add(self._fn_one(batch))
    return out.result()


def _has_composite(x: Any) -> bool:
  """Whether `x` (any nesting) holds a `tf.RaggedTensor` or
  `tf.SparseTensor`, which Keras' predict takes as input rows."""
  return any(isinstance(v, (tf.RaggedTensor, tf.SparseTensor))
             for v in tf.nest.flatten(x))


def _padded_composite(x: Any, multiple: int) -> tuple[int, Any]:
  """`x`'s rows and `x` with rows appended up to a multiple of `multiple`
  (so no replica gets an empty part of the last batch, which TF cannot
  split for a sparse tensor): empty rows of a sparse tensor, copies of the
  last row of a ragged one, zero rows of an array. Lists become tuples
  (several inputs, not one stacked tensor)."""
  flat = tf.nest.flatten(x)
  n = int(_rows_of(flat[0]))
  extra = (-n) % multiple

  def pad(v):
    if isinstance(v, tf.SparseTensor):
      return tf.sparse.reset_shape(v, [n + extra, *v.dense_shape[1:]])
    if isinstance(v, tf.RaggedTensor):
      return tf.concat([v, tf.gather(v, tf.fill([extra], n - 1))], axis=0)
    return inputs_lib.pad_rows(np.asarray(v), n + extra)

  structure = tuple(x) if isinstance(x, list) else x
  return n, tf.nest.pack_sequence_as(structure, [pad(v) for v in flat])


def _rows_of(v: Any) -> int:
  if isinstance(v, tf.RaggedTensor):
    return int(v.nrows())
  if isinstance(v, tf.SparseTensor):
    return int(v.dense_shape[0])
  return len(v)


def _streamed_batches(x: Any, batch: int) -> tf.data.Dataset:
  """`x`'s rows as batches of exactly `batch` rows (the last one padded with
  zero rows), sliced from the arrays as they are needed: no copy of the
  whole input is made (`from_tensor_slices` would hold one).

  Each batch is a copy, never a view of the user's array: TF takes an
  aligned array a generator yields without copying it, and a model's
  first op may then write its result over it (a mirrored predict
  overwrote the caller's `x` with its normalized rows)."""
  n = len(tf.nest.flatten(x)[0])

  def rows(a: np.ndarray, start: int) -> np.ndarray:
    part = a[start:start + batch]
    return part.copy() if len(part) == batch else inputs_lib.pad_rows(
        part, batch)

  def batches():
    for start in range(0, n, batch):
      yield tf.nest.map_structure(lambda a: rows(a, start), x)

  spec = tf.nest.map_structure(
      lambda a: tf.TensorSpec((batch, *a.shape[1:]), tf.as_dtype(a.dtype)), x)
  return tf.data.Dataset.from_generator(batches, output_signature=spec)


class _Rows:
  """Output chunks written into arrays allocated once (`n` rows if known),
  so the predictions are held once, not once per chunk plus a copy."""

  def __init__(self, n: int | None, verbose: int | str = 0):
    self.n = n
    self.done = 0
    self.chunks: list[Any] = []
    self.arrays: list[np.ndarray] | None = None
    self.structure = None
    self.progress = progress_lib.EpochProgress(
        1, 1, n, title="Predict", interactive=None if verbose != 2 else False
    ) if verbose else None
    self.shown, self.start = 0, time.perf_counter()

  def add(self, chunk: Any) -> None:
    flat = [np.asarray(t) for t in tf.nest.flatten(chunk)]
    if self.progress is not None:
      self._show(len(flat[0]))
    if self.n is None:
      self.chunks.append(flat)
      self.structure = chunk
      return
    if self.arrays is None:
      self.structure = chunk
      self.arrays = [np.empty((self.n, *f.shape[1:]), _kept_dtype(f))
                     for f in flat]
    take = min(len(flat[0]), self.n - self.done)
    for array, f in zip(self.arrays, flat):
      array[self.done:self.done + take] = f[:take]
    self.done += take

  def _show(self, rows: int) -> None:
    """The progress line: rows done (a padded last batch counts only the
    input's) and rows per second."""
    self.shown += rows if self.n is None else min(rows, self.n - self.shown)
    seconds = max(time.perf_counter() - self.start, 1e-9)
    self.progress.update(self.shown, {}, self.shown / seconds)

  def result(self) -> Any:
    if self.progress is not None:
      self.progress.end()
    if self.n is None:
      if not self.chunks:
        raise ValueError("x is an empty dataset: nothing to predict.")
      self.arrays = [np.concatenate(parts).astype(_kept_dtype(parts[0]),
                                                  copy=False)
                     for parts in zip(*self.chunks)]
    return tf.nest.pack_sequence_as(self.structure, self.arrays)


def _handles(model: Any) -> tuple[int, ...]:
  """Which storage each of `model`'s variables has now (ZeRO's sharding
  gives a Keras variable a new one on its owner's device)."""
  return tuple(id(getattr(v, "value", v))
               for v in getattr(model, "variables", ()))


def _kept_dtype(array: np.ndarray) -> Any:
  """What an output is returned as: float32 for floats (any precision),
  else its own dtype (integer ids would lose digits as float32)."""
  return np.float32 if array.dtype.kind == "f" or array.dtype.name == (
      "bfloat16") else array.dtype


def _predict_function(model, strategy) -> Callable[..., Any]:
  """`fn(iterator, k)`: k batches' outputs (any structure), gathered in
  replica order."""

  def replica_fn(x):  # Floats as float32; integer outputs (ids) as they are.
    return tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t,
        model(x, training=False))

  def one(batch):
    per_replica = strategy.run(replica_fn, args=(batch,))
    return tf.nest.map_structure(lambda t: strategy.gather(t, axis=0),
                                 per_replica)

  def run(iterator, k):
    first = one(next(iterator))
    flat = tf.nest.flatten(first)
    arrays = [tf.TensorArray(t.dtype, size=k, infer_shape=False).write(0, t)
              for t in flat]
    for i in tf.range(1, k):
      outs = tf.nest.flatten(one(next(iterator)))
      arrays = [a.write(i, t) for a, t in zip(arrays, outs)]
    return tf.nest.pack_sequence_as(first, [a.concat() for a in arrays])

  # Each Predictor's functions count their own traces (TF warned at the
  # fifth Predictor, counting by `run`'s code shared by all).
  run = distributed.compiled(run)
  run.one = distributed.compiled(one, reduce_retracing=True)
  return run


_PREDICTORS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def predict(model: Any, x: Any, *, strategy: Any = None,
            batch_size: int = 1024, steps_per_execution: int = 4,
            precision: str = "float32", prefetch: bool = True,
            output_kind: str = "logits", verbose: int | str = 0) -> Any:
  """Predictions for every row of `x`, in input order, on any placement.

  A final partial batch is padded and trimmed, so no row is dropped or
  duplicated whatever the batch size and replica count. The compiled
  function is kept per model and options (see `Predictor`).

  Args:
    model: a Keras model, or a staged / pipelined / branch-parallel model;
      or the path of a `.keras` file or SavedModel (`load_model`), loaded
      for this call (load it once yourself to serve many calls).
    x: input rows: an array, a dict/list/tuple of arrays, or a
      `tf.data.Dataset` of batches (see `Predictor.predict`).
    strategy, batch_size, steps_per_execution, precision, prefetch: see
      `Predictor`.
    output_kind: `logits`, `probabilities` or `classes` (see
      `convert_outputs`). Defaults to `logits`.
    verbose: `0` silent, `1` or `"auto"` a progress line of rows done, `2`
      it once at the end (see `Predictor.predict`). Defaults to `0`.

  Returns:
    A float32 numpy array (an integer output keeps its dtype) with a row
    per input row (a list or dict of them for a model with several
    outputs); 0 input rows give the same with 0 rows (Keras' own
    `predict` fails on them).

  Raises:
    ValueError: rows that do not fit the model's input, or bad options.
  """
  if isinstance(model, (str, os.PathLike)):  # Loaded for this call only.
    model = load_model(os.fspath(model))
  key = (id(strategy) if not isinstance(strategy, str) else strategy,
         batch_size, steps_per_execution, precision, prefetch)
  cache = _PREDICTORS.setdefault(model, {})
  if key not in cache:
    cache[key] = Predictor(model, strategy=strategy, batch_size=batch_size,
                           steps_per_execution=steps_per_execution,
                           precision=precision, prefetch=prefetch)
  else:  # Its copy (mirrored, another precision) takes today's weights.
    cache[key].refresh()
  return cache[key].predict(x, output_kind=output_kind, verbose=verbose)


# ------------------------------------------------------- load and export

class SavedModelPredictor:
  """Wraps a SavedModel's serving function so `predict` can call it.

  Loaded under a strategy's scope (`under`), its variables are replicated
  and `predict` runs it on every replica, as TF's "save and load with a
  distribution strategy" guide does. A model with several inputs takes a
  dict keyed by the signature's input names (`input_names`); one with
  several outputs returns a dict of them, keyed by the signature's output
  names (those of a Keras export: the model's output names, or
  `output_0`, `output_1`, ... for a list).
  """

  def __init__(self, path: str, strategy: tf.distribute.Strategy | None = None):
    self.path = path
    self.strategy = strategy
    with strategy.scope() if strategy else contextlib.nullcontext():
      self._loaded = tf.saved_model.load(path)
    self._fn = getattr(self._loaded, "signatures", {}).get("serving_default")
    if self._fn is None:
      raise ValueError(f"SavedModel {path!r} has no 'serving_default' "
                       "signature to predict with.")
    args, kwargs = self._fn.structured_input_signature
    if len(args) + len(kwargs) == 0 or (args and len(args) + len(kwargs) > 1):
      raise ValueError(f"SavedModel {path!r}'s serving signature takes "
                       f"{len(args)} positional and {len(kwargs)} named "
                       "inputs; predict serves named inputs (or one).")
    self.input_names = list(kwargs)  # Empty: one positional input.
    shapes = [tuple(spec.shape) for spec in list(args) + list(kwargs.values())]
    self.input_shape = shapes[0] if len(shapes) == 1 else shapes
    self.name = os.path.basename(path.rstrip("/"))
    outputs = self._fn.structured_outputs
    self.output_names = list(outputs) if isinstance(outputs, dict) else []
    self.output_shape = (tuple(next(iter(outputs.values())).shape)
                         if len(self.output_names) == 1 else None)

  def under(self, strategy: tf.distribute.Strategy) -> "SavedModelPredictor":
    """This SavedModel loaded in `strategy`'s scope (itself if it is)."""
    if self.strategy is strategy:
      return self
    return SavedModelPredictor(self.path, strategy)

  def check_inputs(self, x) -> None:
    """Raises a clear `ValueError` for inputs the signature does not take
    (called before tracing)."""
    self._arguments(x)

  def _arguments(self, x) -> dict[str, Any]:
    """`x` by input name; a clear error for inputs the signature lacks."""
    if len(self.input_names) <= 1 and not isinstance(x, dict):
      return {self.input_names[0]: x} if self.input_names else {}
    if not isinstance(x, dict) or set(x) != set(self.input_names):
      got = sorted(x) if isinstance(x, dict) else type(x).__name__
      raise ValueError(
          f"SavedModel {self.path!r} takes the inputs "
          f"{sorted(self.input_names)}; x is {got}. Give x as a dict "
          "{input name: array} with exactly those names.")
    return dict(x)

  def __call__(self, x, training=False):
    del training  # A SavedModel's serving function is inference-only.
    out = (self._fn(**self._arguments(x)) if self.input_names
           else self._fn(x))
    if not isinstance(out, dict):
      return out
    if len(out) == 1:
      return next(iter(out.values()))
    if set(out) == {f"output_{i}" for i in range(len(out))}:
      return [out[f"output_{i}"] for i in range(len(out))]  # Keras: a list.
    return out


def load_model(path: str) -> Any:
  """Loads a `.keras` file or a SavedModel directory for `predict`.

  A directory without `saved_model.pb` that holds `model.keras` (a training
  run's `--model_dir`) loads that file.

  Raises:
    FileNotFoundError: `path` does not exist (named in the message).
    ValueError: a file that is neither, or a directory holding neither
      (the message lists the `.keras` files it does hold).
  """
  if not os.path.exists(path):
    parent = os.path.dirname(path) or "."
    if os.path.basename(path) == "model.keras" and os.path.isdir(parent):
      _keras_file_in(parent)  # A run's directory: what it holds, and how.
    raise FileNotFoundError(
        f"model_path={path!r} does not exist. Train one with "
        "`python -m tfmgpu.train --model_dir=DIR` (it saves DIR/model.keras).")
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "saved_model.pb")):
      return SavedModelPredictor(path)
    _refuse_hub_preset(path)
    directory, path = path, _keras_file_in(path)
    logging.info("model_path=%r is a directory without saved_model.pb: "
                 "loading %s.", directory, path)
  if not path.endswith(".keras"):
    raise ValueError(f"model_path={path!r} is not a .keras file or a "
                     "SavedModel directory.")
  return _load_keras_file(path)


def _import_recorded_model_code(directory: str) -> str | None:
  """Imports the model file or module (`--model=my_model.py:build`) that
  the run which saved a model in `directory` recorded in its `run.json`,
  so that the custom layers it registers load (Keras: "Could not locate
  class"). Only an absolute path to an existing file (what runs record)
  or a module. `None` when it imported it, else why not (`""`: no record
  of such code)."""
  record = os.path.join(directory, rundir.RECORD_NAME)
  try:
    value = (rundir.read_record(directory) or {}).get("model")
    ref = (user_code.parse_reference("model", value)
           if user_code.is_reference(value) else None)
  except (rundir.RunDirError, user_code.UserCodeError):
    return ""
  if ref is None:
    return ""  # No record, or a registry name.
  if ref.is_file and not (os.path.isabs(ref.module)
                          and os.path.isfile(ref.module)):
    return (f"{record} records --model={value}, and {ref.module} is not "
            "there now: give the file back its path, or load in Python.")
  logging.info("Importing %s, the model code %s records, for a class Keras "
               "could not find.", value, record)
  try:
    user_code.load_function("model", value)
  except (user_code.UserCodeError, SystemExit) as e:
    return f"importing the model code {record} records failed: {e}"
  return None


def _refuse_hub_preset(directory: str) -> None:
  """Raises for a keras_hub preset directory (`config.json` and
  `metadata.json`, as `save_to_preset` writes), saying how to make a
  `.keras` file of it (it was told only "Pass a .keras file or a
  SavedModel directory")."""
  if not all(os.path.isfile(os.path.join(directory, f))
             for f in ("config.json", "metadata.json")):
    return
  raise ValueError(
      f"model_path={directory!r} is a keras_hub preset directory; predict "
      "and generate load a .keras file or a SavedModel directory. Make one "
      "from the preset in Python: `keras_hub.models.CausalLM.from_preset("
      f"{directory!r}, preprocessor=None).save('model.keras')` (a "
      "classifier: keras_hub.models.TextClassifier), then pass "
      "--model_path=model.keras; or train from it with --model=<family> "
      f"--model_preset={directory} --model_dir=DIR, which saves "
      "DIR/model.keras.")


# The model config Keras puts in "could not be deserialized properly",
# once per nested layer: kilobytes that hide its last line, the cause.
_CONFIG = re.compile(r"\n\nconfig=.*?\.\n\nException encountered: ", re.S)

# Keras' words for a class or function no imported module registers.
_UNKNOWN = re.compile(r"Could not locate (?:class|function) '([^']+)'")


def _keras_load(path: str) -> keras.Model:
  """`keras.saving.load_model(path)` without compiling. A keras_hub task
  inside the model compiles itself as it is rebuilt, with an optimizer of
  its own that the file's (none) does not fill: Keras' "Skipping variable
  loading for optimizer" warning on every load read as lost state (a new
  user's trial), and serving never uses that optimizer."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=UserWarning,
                            message="Skipping variable loading for optimizer")
    return keras.saving.load_model(
        path, compile=False, custom_objects=models_lib.custom_objects())


def _load_keras_file(path: str) -> keras.Model:
  """Loads a `.keras` file; a damaged one is named, not a raw traceback. A
  class Keras cannot find is looked for in the model code of the run that
  saved it (`_import_recorded_model_code`), then the load is tried again."""
  size = os.path.getsize(path)
  if not zipfile.is_zipfile(path):  # Keras would say "File not found".
    raise ValueError(
        f"model_path={path!r} is not a valid .keras file ({size} bytes, not "
        "a zip archive). It may be truncated or damaged: save the model "
        "again, or restore it from the run's checkpoints.")
  why = ""  # Why the run's own code was not imported, if it was not.
  try:
    try:
      return _keras_load(path)
    except (ValueError, TypeError) as e:  # A class of the run's own code?
      if _UNKNOWN.search(str(e)):
        why = _import_recorded_model_code(os.path.dirname(
            os.path.abspath(path)))
      if why is not None:
        raise
    return _keras_load(path)
  except (OSError, KeyError, EOFError, zipfile.BadZipFile,
          json.JSONDecodeError) as e:  # A damaged member of the zip.
    why = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    raise ValueError(
        f"model_path={path!r} is not a valid .keras file ({size} bytes: "
        f"{why}). It may be truncated or damaged: save the model again, or "
        "restore it from the run's checkpoints.") from e
  except (ValueError, TypeError) as e:  # No weights, an unknown class, ...
    unknown = _UNKNOWN.search(str(e))
    if unknown:  # Keras' message holds the whole model config.
      raise ValueError(
          f"model_path={path!r} uses {unknown.group(1)!r}, which no module "
          "imported here registers. A class of your own: import the module "
          "that defines it, load the model in Python and pass it to "
          "tfmgpu.predict (a training run's model.keras imports the --model "
          "file its run.json records)." + (f" Here {why}" if why else "")
      ) from e
    kind = TypeError if isinstance(e, TypeError) else ValueError
    said, configs = _CONFIG.subn(" Keras said: ", str(e))
    said = said.replace("\n\nException encountered: ", " Keras said: ")
    fix = (" A layer of your own rebuilds from its get_config(): return "
           "every __init__ argument from get_config() and pass **kwargs on "
           "to super().__init__." if configs else "")
    if fix:
      said = said.rstrip(". ") + "."
    raise kind(f"model_path={path!r} ({size} bytes) did not load: "
               f"{said}{fix}") from e


def _natural_key(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _keras_file_in(directory: str) -> str:
  """`directory/model.keras`, or an error saying what the directory holds."""
  saved = os.path.join(directory, "model.keras")
  if os.path.isfile(saved):
    return saved
  found = sorted((f for f in os.listdir(directory) if f.endswith(".keras")),
                 key=_natural_key)
  looked_for = (f"model_path={directory!r} is a directory without "
                "saved_model.pb (a SavedModel) or model.keras (a training run)")
  if not found:
    raise ValueError(f"{looked_for}, and it holds no .keras file. Pass a "
                     ".keras file or a SavedModel directory.")
  paths = ",".join(os.path.join(directory, f) for f in found)
  if all(re.fullmatch(r".*\.branch\d+\.keras", f) for f in found):
    fix = ("they are the branches of a branch_parallel run: pass them "
           f"comma-separated with --strategy=branch_parallel, e.g. "
           f"--model_path={paths} --strategy=branch_parallel.")
  else:
    fix = ("pass one of them as the model path (several, comma-separated, "
           "with --strategy=branch_parallel).")
  raise ValueError(f"{looked_for}. It holds {', '.join(found)}; {fix}")


def load_weights(model: keras.Model, path: str) -> keras.Model:
  """Loads a `.weights.h5` file into `model`, naming both on a mismatch."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"weights file {path!r} does not exist.")
  try:
    model.load_weights(path)
  except (ValueError, KeyError) as e:
    shapes = [tuple(w.shape) for w in model.weights]
    raise ValueError(
        f"weights file {path!r} does not match model {model.name!r} (its "
        f"weights have shapes {shapes}): {str(e).splitlines()[0]}") from e
  return model


def export_saved_model(model: Any, path: str) -> str:
  """Exports a SavedModel that plain TF (or TF Serving) loads without tfmgpu.

  A staged or replicated model is exported unsplit, from a single-device
  copy, so the SavedModel holds plain variables. Its endpoint `serve` is
  the model's forward pass (also `serving_default`); a causal LM (`gpt`, a
  keras_hub `CausalLM`) gets a second signature, `generate`: greedy
  decoding with a KV cache, in TF (`tfmgpu.generation.export`).

  The directory is written whole or not at all: an export replaces an
  earlier SavedModel at `path`, and refuses a file or a directory of other
  files there (`ValueError`).
  """
  from tfmgpu.generation import export as generation_export  # pylint: disable=g-import-not-at-top
  model = placed_model.unsplit_of(model)
  if placed_model.is_placed(model):  # Several models side by side.
    raise ValueError(
        f"export_saved_model exports one Keras model; {model.name!r} "
        f"({type(model).__name__}) runs several side by side and has no "
        "single-model form. Export each branch (model.branches[i]) alone; "
        "save them (.keras) for python -m tfmgpu.predict "
        "--strategy=branch_parallel --model_path=a.keras,b.keras; or build "
        "the ensemble as one functional model (keras.Model(x, "
        "keras.layers.Average()([b(x) for b in branches]))) and export it.")
  plain = cloning.copy_model(
      model, same_class=generation_export.keeps_its_class(model))
  archive = keras.export.ExportArchive()
  archive.track_and_add_endpoint("serve", plain,
                                 _compat.export_input_signature(plain))
  generate = generation_export.signature_for(plain)
  if generate is not None:
    archive.add_endpoint(generation_export.SIGNATURE, generate)
  return files.write_directory_atomically(  # The user's files kept whole.
      path, lambda name: archive.write_out(name, verbose=False),
      marker="saved_model.pb")


# ------------------------------------------------------- serving a run

def place_for_serving(models: list, strategy: str, **options) -> tuple:
  """Places loaded models as the distribution `strategy` serves them.

  Args:
    models: the loaded models (several for `branch_parallel`).
    strategy: a registered name.
    **options: that distribution's options (its `Options` fields).

  Returns:
    `(model, tf_strategy)`; `tf_strategy` is `None` when the model places
    itself (placements).
  """
  distribution = strategies_lib.lookup(strategy)
  return distribution.serve(models, distribution.options(**options))


OUTPUT_KINDS = ("logits", "probabilities", "classes")
VERBOSE = (0, 1, 2, "auto")  # Keras' `predict(verbose=...)` values.


def convert_outputs(predictions: Any, kind: str = "logits") -> Any:
  """A classifier's outputs as logits, probabilities or classes.

  Args:
    predictions: what `predict` returns: one array or a list/dict of them,
      each holding class scores on its last axis (`C >= 2` of them).
    kind: `logits`: unchanged; `probabilities`: a softmax over the last
      axis (outputs that already are probabilities, non-negative and
      summing to 1, are kept); `classes`: the index of the highest score
      (int32, the last axis dropped).

  Returns:
    The same nesting of arrays.

  Raises:
    ValueError: an unknown `kind`, or an output without class scores.
  """
  checks.check_choice("output_kind", kind, OUTPUT_KINDS)
  if kind == "logits":
    return predictions
  if isinstance(predictions, dict):
    return {k: _convert(v, kind, k) for k, v in predictions.items()}
  if isinstance(predictions, (list, tuple)):
    return type(predictions)(_convert(v, kind, f"output_{i}")
                             for i, v in enumerate(predictions))
  return _convert(predictions, kind, "the output")


def holds_class_scores(output: Any) -> bool:
  """Whether a model's output holds class scores on its last axis (`C >= 2`
  of them), as `convert_outputs` needs; a regression's does not."""
  shape = np.shape(output)
  return len(shape) >= 2 and shape[-1] >= 2


def _convert(scores: Any, kind: str, name: str) -> np.ndarray:
  scores = np.asarray(scores, np.float32)
  if not holds_class_scores(scores):
    raise ValueError(
        f"output_kind={kind!r} needs class scores, but {name} has shape "
        f"{scores.shape} (per row, {scores.shape[1:] or 'one value'}). Use "
        "output_kind='logits' for a regression or a single-unit output.")
  if kind == "classes":
    return np.argmax(scores, axis=-1).astype(np.int32)
  if np.all(scores >= 0) and np.allclose(scores.sum(-1), 1.0, atol=1e-3):
    return scores  # A softmax output already.
  shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
  return shifted / shifted.sum(axis=-1, keepdims=True)


def save_predictions(path: str, predictions: Any) -> str:
  """Writes the predictions atomically (`tfmgpu.files.write_atomically`): a
  failed or killed run never leaves a partial or temporary file, and the
  file gets the mode of a plain `open` (umask), not 0600.

  One output is written as `.npy`. Several (a dict or list of arrays) are
  written as one `.npz` of named arrays (the dict's keys, or `output_0`,
  `output_1`, ...); a path ending in `.npy` then becomes `.npz`.

  Returns:
    The path written.
  """
  if isinstance(predictions, (dict, list, tuple)):
    named = (dict(predictions) if isinstance(predictions, dict) else
             {f"output_{i}": p for i, p in enumerate(predictions)})
    if path.endswith(".npy"):
      path = path[:-len(".npy")] + ".npz"
    return files.write_atomically(
        path, lambda f: np.savez(f, **{str(k): np.asarray(v)
                                       for k, v in named.items()}))
  return files.write_atomically(path, lambda f: np.save(f, predictions))
