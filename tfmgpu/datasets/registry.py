"""The dataset registry: `Arrays`, `register_dataset`, `load_dataset`.

Datasets are registered by name with a one-line description and a loader
that returns `Arrays` (numpy, already split into train and test) or, for a
streamed entry, a `StreamedDataset`. The built-in datasets register
themselves from their own modules of `tfmgpu.datasets`; a user's loader is
named as `"package.module:function"` or `"path/to/file.py:function"`.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Protocol

from absl import logging
import numpy as np

from tfmgpu import checks
from tfmgpu import user_code
from tfmgpu._lazy import LazyModule

tf = LazyModule("tensorflow")


class DatasetUnavailableError(RuntimeError):
  """A registered dataset cannot be loaded here (e.g. download needed offline)."""


@dataclasses.dataclass(frozen=True)
class Baseline:
  """A simple model's value of a metric on a dataset's test split, which a
  run's summary prints next to the trained model's (e.g. the byte-unigram
  bits per byte of `stdlib_text`).

  Attributes:
    name: what the baseline is, e.g. `"byte-unigram"`.
    metric: the metric name it is a value of, e.g. `"bits_per_byte"`.
    value: its value on the test split.
  """
  name: str
  metric: str
  value: float


@dataclasses.dataclass(frozen=True)
class Arrays:
  """A dataset in memory, split into train and test.

  Attributes:
    name: registry name (or the user's loader reference) it was loaded from.
    x_train, y_train, x_test, y_test: features (float32, NHWC images or flat
      vectors) and integer labels; a user's loader may give a dict, list or
      tuple of arrays for a model with several inputs (or outputs).
    num_classes: number of label values (`None`: targets that are not one
      array of class indices, e.g. regression).
    baselines: values of simple models on the test split (`Baseline`), for
      the run summary; lower is better for every one.
  """
  name: str
  x_train: Any
  y_train: Any
  x_test: Any
  y_test: Any
  num_classes: int | None
  baselines: tuple[Baseline, ...] = ()

  @property
  def input_shape(self) -> Any:
    """Shape of one example, e.g. `(28, 28, 1)`; for several inputs, the
    same nesting of shapes, e.g. `{"image": (28, 28, 1), "tabular": (56,)}`."""
    return _map_leaves(lambda a: tuple(a.shape[1:]), self.x_train)

  def __repr__(self) -> str:
    classes = ("" if self.num_classes is None
               else f", {self.num_classes} classes")
    train, test = (_map_leaves(lambda a: a.shape, x)
                   for x in (self.x_train, self.x_test))
    return f"Arrays({self.name!r}: train {train}, test {test}{classes})"


def _map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
  """`fn` of each array of a dict/list/tuple nesting, the nesting kept."""
  if isinstance(x, dict):
    return {k: _map_leaves(fn, v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return type(x)(_map_leaves(fn, v) for v in x)
  return fn(x)


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
  """One registered dataset.

  Attributes:
    name: the registry key (`--dataset` value).
    description: one line for help text.
    loader: `loader(**options) -> Arrays`.
    offline: it needs no download.
    options: the run settings the loader takes from a `TrainConfig`
      (`seed`, `path`): declared, not guessed from its signature.
    streamed: the loader returns a `StreamedDataset` (read from files while
      training) instead of `Arrays`.
    metrics: the metrics a run reports when none are given (`None`:
      `accuracy`, the default loss's).
  """
  name: str
  description: str
  loader: Callable[..., Any]
  offline: bool
  options: tuple[str, ...] = ()
  streamed: bool = False
  metrics: tuple[str, ...] | None = None


class StreamedDataset(Protocol):
  """A dataset read from files while training, not loaded into memory.

  What a `streamed=True` registry entry's loader returns (see
  `tfmgpu.datasets.tfrecord.TFRecordSource`): the example shape and class count for
  the model, and dataset functions for `Trainer.fit` / `evaluate`.
  """
  name: str
  input_shape: tuple[int, ...]
  num_classes: int

  def steps_per_epoch(self, global_batch_size: int) -> int:
    """Global batches in one pass over the training examples."""

  def train_dataset_fn(self, global_batch_size: int, *,
                       independent_workers: bool = False) -> Callable:
    """An endless `fn(input_context) -> tf.data.Dataset` of per-replica
    batches, with `fn.from_step(step)` to resume at a global step."""

  def test_dataset_fn(self, global_batch_size: int) -> Callable:
    """A finite `fn(input_context)`: each test example once."""

  def to_arrays(self) -> Arrays:
    """Both splits read into memory."""

  def explain_read_error(self, error: Exception) -> Exception:
    """An error that reading the files raised while training or evaluating
    (e.g. a `tf.errors.DataLossError`), explained: naming the damaged
    file; `error` itself when nothing more is known."""


_REGISTRY: dict[str, DatasetEntry] = {}


def register_dataset(name: str, description: str, *, offline: bool = True,
                     options: tuple[str, ...] = (), streamed: bool = False,
                     metrics: tuple[str, ...] | None = None):
  """Decorator registering `loader(**options) -> Arrays` under `name`.

  Args:
    name: the registry key.
    description: one line for help text.
    offline: the loader needs no download.
    options: which run settings (`"seed"`, `"path"`) a run passes it.
    streamed: the loader returns a `StreamedDataset` instead of `Arrays`.
    metrics: metric names a run reports when it is given none and uses the
      default loss (`None`: `accuracy`).
  """
  def decorate(loader):
    if name in _REGISTRY:
      raise ValueError(f"dataset name {name!r} is already registered.")
    _REGISTRY[name] = DatasetEntry(
        name, description, loader, offline, tuple(options), streamed,
        None if metrics is None else tuple(metrics))
    return loader
  return decorate


def unregister_dataset(name: str) -> None:
  """Removes a registered dataset (tests and plugins that clean up)."""
  _REGISTRY.pop(name, None)


def available_datasets() -> dict[str, str]:
  """Returns `{name: one-line description}` for every registered dataset."""
  return {n: e.description for n, e in _REGISTRY.items()}


def dataset_entry(name: str) -> DatasetEntry:
  """Looks up a dataset: the one lookup of dataset names.

  Args:
    name: a registered name, or a reference to the user's loader
      (`"package.module:function"`, `"path/to/file.py:function"`; see
      `USER_LOADER_CALL`), which is imported and its signature checked.

  Raises:
    ValueError: unknown names list the available ones; a reference that
      cannot be used raises `tfmgpu.user_code.UserCodeError`.
  """
  if user_code.is_reference(name):
    return _user_entry(name)
  if name not in _REGISTRY:
    raise ValueError(f"Unknown dataset name={name!r}."
                     f"{checks.did_you_mean(name, _REGISTRY)} Available names: "
                     f"{', '.join(sorted(_REGISTRY))}; or your own loader as "
                     f"{user_code.FORMS}.")
  return _REGISTRY[name]


def default_metrics(name: str) -> tuple[str, ...] | None:
  """The metrics registered dataset `name` reports by default (`None`: the
  default loss's `accuracy`; also for a user's loader, never imported here)."""
  entry = _REGISTRY.get(name)
  return None if entry is None else entry.metrics


# ------------------------------------------------------- the user's loader

# A user's loader is called with `seed=` and `path=` (`--seed`,
# `--data_path`) only if it names them (or takes **kwargs): `load()`,
# `load(seed=0)`, `load(path=None, seed=0)` all work.
USER_LOADER_CALL = user_code.Call(options=("seed", "path"), shown="load()")


def check_dataset(name: str) -> None:
  """Checks a dataset setting without importing user code or TensorFlow.

  Raises:
    ValueError: an unknown name (listing the registered ones) or a
      reference that cannot be used (`tfmgpu.user_code.UserCodeError`).
  """
  user_code.check_name("dataset", name, _REGISTRY, USER_LOADER_CALL)


def _user_entry(name: str) -> DatasetEntry:
  """An entry for the user's loader `name` (imported and checked)."""
  loader = user_code.load_function("dataset", name, USER_LOADER_CALL)

  def load(**options) -> "Arrays | UserDatasets":
    loaded = loader(**options)
    datasets = user_datasets(name, loaded)
    return datasets if datasets is not None else user_arrays(name, loaded)

  return DatasetEntry(
      name, f"your loader {name}", load, offline=True,
      options=user_code.keyword_options(loader, USER_LOADER_CALL.options))


def user_arrays(name: str, loaded: Any) -> Arrays:
  """A user loader's result as `Arrays`.

  Args:
    name: the loader, for messages and `Arrays.name`.
    loaded: `Arrays`, or `((x_train, y_train), (x_test, y_test))` as
      `keras.datasets` return them, where each `x` (and `y`) is an array or
      a dict/list/tuple of arrays (one per model input or output), with one
      row per example. `num_classes` is `max(y) + 1` when `y` is one array
      of non-negative integers (a label per example, or per token:
      `(N, T)`), else `None`.

  Raises:
    ValueError: anything else, or parts with different row counts.
  """
  if isinstance(loaded, Arrays):
    return loaded
  try:
    (x_train, y_train), (x_test, y_test) = loaded
  except (TypeError, ValueError):
    raise ValueError(
        f"dataset={name!r} returned a {type(loaded).__name__}; a loader "
        "returns ((x_train, y_train), (x_test, y_test)) as keras.datasets "
        "do (each x and y an array, or a dict/list of arrays for several "
        "inputs), or tfmgpu.data.Arrays.") from None
  parts = [_map_leaves(np.asarray, p) for p in (x_train, y_train, x_test,
                                                y_test)]
  for split, (x, y) in (("train", parts[:2]), ("test", parts[2:])):
    rows = {len(a) for a in _leaf_list(x) + _leaf_list(y)}
    if len(rows) != 1:
      raise ValueError(f"dataset={name!r}: the {split} arrays have different "
                       f"row counts {sorted(rows)}; give one row per example "
                       "in every x and y array.")
  return Arrays(name, *parts, num_classes=_class_count(parts[1], parts[3]))


def _is_dataset_or_fn(value: Any) -> bool:
  """A `tf.data.Dataset` or a dataset function (TF is loaded if a loader
  returned a dataset; a plain callable is taken for a dataset function)."""
  loaded = sys.modules.get("tensorflow")
  return callable(value) or (loaded is not None
                             and isinstance(value, loaded.data.Dataset))


def user_datasets(name: str, loaded: Any) -> "UserDatasets | None":
  """A user loader's `tf.data` result as `UserDatasets` (`None`: not one).

  Args:
    name: the loader, for messages and the name.
    loaded: a `tf.data.Dataset` of `(x, y[, sample_weight])` global
      batches, a dataset function `fn(input_context)` of per-replica
      batches (as `Trainer.fit` takes them), or a pair `(train, test)` of
      them (`test` may be `None`).
  """
  if _is_dataset_or_fn(loaded):
    return UserDatasets(name, loaded)
  if (isinstance(loaded, (tuple, list)) and len(loaded) == 2
      and _is_dataset_or_fn(loaded[0])
      and (loaded[1] is None or _is_dataset_or_fn(loaded[1]))):
    return UserDatasets(name, loaded[0], loaded[1])
  return None


class UserDatasets:
  """What a user's loader returned as `tf.data`: a training dataset (or
  dataset function) and an optional test one, trained on as `Trainer.fit`
  takes them (the dataset sets the batch).

  Args:
    name: the loader reference.
    train: a `tf.data.Dataset` of global batches, or a dataset function.
    test: the same for the test split, or `None`.
  """

  def __init__(self, name: str, train: Any, test: Any = None):
    self.name, self.train, self.test = name, train, test
    spec = self._dataset(train).element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
      raise ValueError(
          f"dataset={name!r} returned a dataset of {spec}; its elements must "
          "be (x, y) or (x, y, sample_weight) batches.")
    unknown = [t for t in tf.nest.flatten(spec[:2]) if t.shape.rank is None]
    if unknown:
      raise ValueError(
          f"dataset={name!r} returned a dataset whose elements have unknown "
          f"rank ({unknown[0]}: tf.py_function / tf.numpy_function outputs "
          "carry no shape), so the model's input shape cannot be read from "
          "it. Give them one in your map: x = tf.ensure_shape(x, [None, 28, "
          "28, 1]) (or x.set_shape(...)), likewise y.")
    self.input_shape = tf.nest.map_structure(
        lambda t: tuple(t.shape[1:]), spec[0])
    self.num_classes = self._class_count(spec[1])

  @staticmethod
  def _dataset(data: Any):
    """`data` as a `tf.data.Dataset` (a dataset function called with one
    input pipeline's context)."""
    if isinstance(data, tf.data.Dataset):
      return data
    return data(tf.distribute.InputContext())

  def _class_count(self, spec: Any) -> int | None:
    """`max(y) + 1` over the training labels (one pass; the first 100
    batches of an infinite dataset), or `None` for other targets."""
    if not (isinstance(spec, tf.TensorSpec) and spec.dtype.is_integer and (
        spec.shape.rank == 1 or (spec.shape.rank == 2 and spec.shape[1] == 1))):
      return None
    labels = self._dataset(self.train).map(lambda *e: tf.reduce_max(e[1]))
    if labels.cardinality() == tf.data.INFINITE_CARDINALITY:
      labels = labels.take(100)
      logging.info("dataset=%r is infinite: num_classes from the labels of "
                   "its first 100 batches.", self.name)
    top = int(labels.reduce(tf.constant(-1, spec.dtype), tf.maximum))
    return top + 1 if top >= 0 else None

  def to_arrays(self) -> Arrays:
    """Both splits read into memory (the training one as test when the
    loader gave none); for `predict`."""
    def read(data):
      batches = list(self._dataset(data).as_numpy_iterator())
      joined = [tf.nest.map_structure(lambda *a: np.concatenate(a), *part)
                for part in zip(*batches)]
      return joined[0], joined[1]
    (x, y), test = read(self.train), (None if self.test is None
                                      else read(self.test))
    x_test, y_test = test or (x, y)
    return Arrays(self.name, x, y, x_test, y_test,
                  num_classes=self.num_classes)

  def __repr__(self) -> str:
    test = "" if self.test is None else ", a test dataset"
    return (f"UserDatasets({self.name!r}: input {self.input_shape}, "
            f"{self.num_classes} classes{test})")


def _leaf_list(x: Any) -> list[np.ndarray]:
  leaves: list[np.ndarray] = []
  _map_leaves(leaves.append, x)
  return leaves


def _class_count(y_train: Any, y_test: Any) -> int | None:
  """`max + 1` of integer class labels, one per example `(N,)` or one per
  token `(N, T, ...)` (a language model's next tokens); `None` for other
  targets (floats, several arrays, negative labels: said, as a model built
  for classes then fails)."""
  ys = (y_train, y_test)
  if not all(isinstance(y, np.ndarray) and y.dtype.kind in "iu"
             and y.ndim >= 1 for y in ys):
    return None
  for split, y in zip(("y_train", "y_test"), ys):
    if y.size and y.min() < 0:
      i = int(np.argmin(y.reshape(-1)))
      logging.warning(
          "%s[%d]=%d is negative: the integer targets are not class indices "
          "(0..K-1), so num_classes is not known and a model built for "
          "classes cannot be made. Class labels must be 0..K-1; give "
          "regression targets as floats.", split, i, y.flat[i])
      return None
  return int(max(y.max(initial=0) for y in ys)) + 1


def load_dataset(name: str = "digits", **options) -> Arrays:
  """Loads a registered dataset into memory.

  Args:
    name: a registered name; see `available_datasets()`. Defaults to
      `"digits"` (real 28x28 digits that ship offline).
    **options: loader options, e.g. `test_fraction`, `seed`, `path`.

  Returns:
    `Arrays` with float32 features scaled to [0, 1] and int32 labels (a
    streamed dataset is read into memory whole; see `open_dataset`).

  Raises:
    ValueError: unknown name (lists the available ones) or bad option.
    DatasetUnavailableError: a download is needed and failed.
  """
  loaded = dataset_entry(name).loader(**options)
  # A streamed dataset, or a user's loader's tf.data datasets: read whole.
  return loaded if isinstance(loaded, Arrays) else loaded.to_arrays()


def open_dataset(name: str = "digits", **options) -> "Arrays | StreamedDataset":
  """What a run trains on: `Arrays`, or a `StreamedDataset` for a streamed
  entry (e.g. `open_dataset("tfrecord", path="DIR/*.tfrecord")`), which
  reads its files while training.

  Raises:
    As `load_dataset`; a streamed loader's own errors (e.g. no files).
  """
  return dataset_entry(name).loader(**options)


def check_features(arrays: Arrays, *, source: str | None = None) -> None:
  """Checks that the float inputs hold no NaN or inf.

  Run before training: a NaN in the data makes the loss NaN at the step
  that reads it, which reads like a learning rate too high.

  Raises:
    ValueError: naming the input, how many values and the first row.
  """
  for split, x in (("x_train", arrays.x_train), ("x_test", arrays.x_test)):
    for name, value in _named_inputs(split, x).items():
      if value.dtype.kind != "f" or np.isfinite(value).all():
        continue
      bad = ~np.isfinite(value.reshape(len(value), -1))
      raise ValueError(
          f"dataset {source or repr(arrays.name)}: {name} holds "
          f"{int(bad.sum())} NaN/inf value(s), the first in row "
          f"{int(np.flatnonzero(bad.any(axis=1))[0])}; the loss would turn "
          "NaN at the step that reads it. Clean the data first (drop those "
          "rows, or np.nan_to_num).")


def _named_inputs(split: str, x: Any) -> dict[str, np.ndarray]:
  """Each input array of `x` (one, or a dict/list/tuple of them) by the
  name a message gives it: `x_train`, `x_train['image']`, `x_train[1]`."""
  leaves = (x.items() if isinstance(x, dict) else
            enumerate(x) if isinstance(x, (list, tuple)) else [(None, x)])
  return {split if key is None else f"{split}[{key!r}]": np.asarray(value)
          for key, value in leaves}


def check_shapes(arrays: Arrays, *, source: str | None = None) -> None:
  """Checks that each input has rows in both splits, of one example shape.

  Run before training: an x_test of another width failed only in the
  final evaluation, after every epoch had trained, and an empty one was
  reported as a test loss and accuracy of 0.

  Raises:
    ValueError: naming the input, the split and the shapes.
  """
  where = f"dataset {source or repr(arrays.name)}"
  train = _named_inputs("x_train", arrays.x_train)
  test = _named_inputs("x_test", arrays.x_test)
  for name, value in {**train, **test}.items():
    if not len(value):
      raise ValueError(
          f"{where}: {name} has no rows (shape {value.shape}). Give both "
          "splits examples: a training run reports its final evaluation on "
          "the test split (hold out some training rows if you have no "
          "other), and predict reads it unless --split=train.")
  for name, value in train.items():  # Inputs paired by key, not by order.
    test_name = "x_test" + name[len("x_train"):]
    other = test.get(test_name)
    if other is not None and value.shape[1:] != other.shape[1:]:
      raise ValueError(
          f"{where}: {test_name} holds examples of shape {other.shape[1:]} "
          f"but {name} of shape {value.shape[1:]}; the model is built for "
          f"{name}'s and could not evaluate {test_name}. Give both splits "
          "the same shape per example.")


def not_class_indices(y: np.ndarray) -> tuple[str, int | None] | None:
  """Why labels `y` are not class indices: `("one-hot", None)` for rows of
  0/1 with one 1 each, `("fraction", i)` for the first float label that is
  not a whole finite number; `None` when they are."""
  if (y.ndim == 2 and y.shape[1] > 1 and len(y) and np.isin(y, (0, 1)).all()
      and (y.sum(axis=1) == 1).all()):
    return "one-hot", None
  if y.dtype.kind == "f":
    bad = np.flatnonzero(~(np.isfinite(y) & (y == np.round(y))))
    if bad.size:
      return "fraction", int(bad[0])
  return None


def check_labels_for_default_loss(arrays: Arrays, *,
                                  source: str | None = None) -> None:
  """Refuses float labels that are not class indices when no loss is
  given: the default loss (sparse categorical cross-entropy) casts each to
  an integer and trains, silently (a new user's trial: targets in (0, 1)
  read as class 0, loss and accuracy 0 every epoch); one-hot rows failed
  in Keras with a rank error.

  Raises:
    ValueError: naming the first such label and the losses to give.
  """
  y = arrays.y_train
  if not (isinstance(y, np.ndarray) and y.dtype.kind == "f" and y.size):
    return
  where = f"dataset {source or repr(arrays.name)}"
  problem = not_class_indices(y)
  if problem is None:
    return
  kind, i = problem
  if kind == "one-hot":
    raise ValueError(
        f"{where}: y_train holds one-hot rows (shape {y.shape}), and no "
        "--loss was given: the default loss, sparse categorical "
        "cross-entropy, takes class indices. Return y.argmax(-1) from your "
        "loader, or give --loss=categorical_crossentropy for a model "
        "ending in a softmax.")
  value = y.flat[i].item()
  read = (f"would read it as class {int(value)}" if np.isfinite(value)
          else "has no class for it")
  raise ValueError(
      f"{where}: y_train[{i}]={value!r} is not a class index, and no --loss "
      f"was given: the default loss (sparse categorical cross-entropy) "
      f"{read}. Give the loss your targets need: --loss=mse (regression), "
      "--loss=binary_crossentropy (0/1 targets, a sigmoid output), or your "
      "own fn as --loss=my_loss.py:fn.")


def check_labels(arrays: Arrays, *, source: str | None = None) -> None:
  """Checks that every label is a class index in `0..num_classes - 1`.

  Run before training: a label out of range would otherwise fail the first
  step with a kernel error.

  Args:
    arrays: the dataset.
    source: where the labels come from, for the message (default: the
      dataset's name).

  Raises:
    ValueError: a label out of range (the first one is named).
  """
  if arrays.num_classes is None:
    return  # Targets that are not class indices: nothing to check.
  for split, y in (("y_train", arrays.y_train), ("y_test", arrays.y_test)):
    y = np.asarray(y)
    if not y.size:
      continue
    bad = np.flatnonzero((y < 0) | (y >= arrays.num_classes))
    if bad.size:
      i = int(bad[0])
      raise ValueError(
          f"dataset {source or repr(arrays.name)}: {split}[{i}]={y.flat[i]} "
          f"is outside the class range 0..{arrays.num_classes - 1} "
          f"({bad.size} label(s) out of range). Labels must be integer class "
          "indices from 0 to num_classes - 1: fix the labels.")
