"""Training and evaluation inputs, taken the way Keras takes them.

`from_user(x, y, sample_weight)` accepts what `keras.Model.fit` accepts and
says who batches what (the Keras conventions):

- **In-memory arrays**: a NumPy array (or anything `np.asarray` takes: a
  tensor, a pandas frame), or a dict, list or tuple of them for a model with
  several inputs or outputs; `y` and `sample_weight` likewise. tfmgpu
  batches them by `global_batch_size`, shuffles them by `(seed, epoch)` and
  gives each replica its share; they can be held on the devices
  (`input_mode="device"`). → `ArrayData`.
- **A `tf.data.Dataset`** yielding `(x, y)` or `(x, y, sample_weight)`,
  already batched: each element is one *global* batch, which TF splits over
  the replicas (`strategy.experimental_distribute_dataset`). Finite (one
  epoch is one pass, unless `steps_per_epoch` says fewer) or infinite (give
  `steps_per_epoch`; the iterator then runs on across epochs). → `DatasetData`.
- **A dataset function** `fn(input_context) -> tf.data.Dataset`, called once
  per input pipeline (worker) by `strategy.distribute_datasets_from_function`.
  It batches by `input_context.get_per_replica_batch_size(global_batch_size)`
  and shards by `input_context.input_pipeline_id` itself. → `DatasetFnData`.

Anything else is refused with an error naming the argument and its type.

Batch arithmetic lives here too: `check_global_batch` (a global batch over
the replicas) and `epoch_order` (each epoch's order of arrays, fixed by the
seed and the epoch, so that a resumed run reads what an uninterrupted one
would).
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Callable, Mapping

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import checks

INFINITE = -1


# ------------------------------------------------------ batch arithmetic

def check_global_batch(global_batch_size: int, num_replicas: int,
                       what: str = "the strategy") -> int:
  """Returns the per-replica batch size, or raises a clear error.

  Raises:
    ValueError: not a positive multiple of `num_replicas`.
  """
  if global_batch_size < 1:
    raise ValueError(f"global_batch_size={global_batch_size} must be >= 1.")
  checks.check_divisible("global_batch_size", global_batch_size,
                         num_replicas, f"the {num_replicas} replicas of {what}")
  return global_batch_size // num_replicas


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example order of one epoch: a permutation fixed by (seed, epoch).

  Deriving it from the epoch number (not from an iterator's state) makes a
  resumed run see exactly the data an uninterrupted run would.
  """
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def epoch_indices(num_examples: int, *, seed: int, epoch: int,
                  shuffle: bool) -> np.ndarray:
  """`epoch_order(num_examples, seed, epoch)` if `shuffle`, else input order."""
  if shuffle:
    return epoch_order(num_examples, seed, epoch)
  return np.arange(num_examples)


def _as_structure(value: Any, what: str) -> Any:
  """Lists become tuples (`tf.data` would stack them); leaves become arrays."""
  if value is None:
    return None
  if isinstance(value, Mapping):
    return {k: _as_structure(v, f"{what}[{k!r}]") for k, v in value.items()}
  if isinstance(value, (list, tuple)) and value and all(
      np.isscalar(v) for v in value):
    value = np.asarray(value)  # A list of numbers is one array.
  if isinstance(value, (list, tuple)):
    return tuple(_as_structure(v, f"{what}[{i}]") for i, v in enumerate(value))
  if isinstance(value, (tf.data.Dataset, str, bytes)) or callable(value):
    raise TypeError(f"{what} is a {type(value).__name__}; inside arrays only "
                    "arrays are accepted (give a dataset as x alone).")
  to_numpy = getattr(value, "to_numpy", None) or getattr(value, "numpy", None)
  array = np.asarray(to_numpy() if to_numpy else value)
  if array.dtype == object:
    raise TypeError(f"{what} is not a numeric array (dtype object, shape "
                    f"{array.shape}); give a NumPy array, or a dict, list or "
                    "tuple of arrays for several inputs.")
  if array.ndim == 0:
    raise ValueError(f"{what} is a scalar ({array!r}); give one row per "
                     "example.")
  return array


def _leaves(structure: Any, path: str):
  """`(path, array)` for every array of a nested structure."""
  if isinstance(structure, Mapping):
    for k, v in structure.items():
      yield from _leaves(v, f"{path}[{k!r}]")
  elif isinstance(structure, tuple):
    for i, v in enumerate(structure):
      yield from _leaves(v, f"{path}[{i}]")
  else:
    yield path, structure


def _rows(data: tuple, what: str) -> int:
  """The common row count of every array in `data`, or a clear error."""
  names = ("x", "y", "sample_weight")
  counts = {p: len(a) for name, part in zip(names, data)
            for p, a in _leaves(part, name)}
  if len(set(counts.values())) > 1:
    listed = ", ".join(f"{p}: {n}" for p, n in counts.items())
    raise ValueError(f"The arrays of {what} have different numbers of rows "
                     f"({listed}); every input, target and weight needs one "
                     "row per example.")
  return next(iter(counts.values()))


@dataclasses.dataclass
class ArrayData:
  """In-memory arrays: `data = (x, y)` or `(x, y, sample_weight)`.

  Attributes:
    data: the arrays, lists turned into tuples.
    num_examples: rows.
  """
  data: tuple

  @property
  def num_examples(self) -> int:
    return len(tf.nest.flatten(self.data)[0])

  @property
  def x(self) -> Any:
    return self.data[0]

  def padded(self, multiple: int) -> tuple:
    """`(x, y, mask[, sample_weight])`, rows padded to a multiple of
    `multiple` (mask 0 on the padding)."""
    n = self.num_examples
    rows = n + (-n) % multiple
    mask = pad_rows(np.ones(n, np.float32), rows)
    grown = tf.nest.map_structure(lambda a: pad_rows(a, rows), self.data)
    return (grown[0], grown[1], mask) + tuple(grown[2:])


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
  """`a` with zero rows appended up to `rows` rows (`a` itself if it has
  them)."""
  if len(a) == rows:
    return a
  return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])


@dataclasses.dataclass
class DatasetData:
  """A user's `tf.data.Dataset` of global batches (see the module docstring)."""
  dataset: tf.data.Dataset

  @property
  def cardinality(self) -> int:
    """Batches per pass; `INFINITE`, or `None` when TF does not know."""
    n = int(self.dataset.cardinality())
    if n == int(tf.data.INFINITE_CARDINALITY):
      return INFINITE
    return None if n < 0 else n


@dataclasses.dataclass
class DatasetFnData:
  """A user's dataset function `fn(input_context) -> per-replica batches`."""
  fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]

  def cardinality(self, strategy: tf.distribute.Strategy) -> int | None:
    """Steps in one pass of this worker's pipeline (`INFINITE`, or `None`).

    The pipeline feeds this worker's replicas in turn: a step takes one
    of its batches per local replica.
    """
    local = _local_replicas(strategy)
    replicas = strategy.num_replicas_in_sync
    pipelines = max(replicas // local, 1)
    ctx = tf.distribute.InputContext(
        num_input_pipelines=pipelines,
        input_pipeline_id=_pipeline_id(strategy, pipelines),
        num_replicas_in_sync=replicas)
    dataset = self.fn(ctx)
    if not isinstance(dataset, tf.data.Dataset):
      raise TypeError(f"x is a function returning {type(dataset).__name__}; "
                      "a dataset function returns a tf.data.Dataset.")
    _check_element(dataset, "x (the dataset function's dataset)")
    n = int(dataset.cardinality())
    if n == int(tf.data.INFINITE_CARDINALITY):
      return INFINITE
    return None if n < 0 else n // local


def dataset_fn_from_step(fn: Callable[..., tf.data.Dataset], step: int):
  """`fn` started at global step `step`: `fn.from_step(step)` when `fn` can
  seek, else `fn(ctx)` with the batches of `step` steps skipped (a step takes
  one batch per replica that the pipeline feeds)."""
  if not step:
    return fn
  if hasattr(fn, "from_step"):
    return fn.from_step(step)

  def skipped(ctx):
    per_pipeline = max(ctx.num_replicas_in_sync // ctx.num_input_pipelines, 1)
    return fn(ctx).skip(step * per_pipeline)

  return skipped


def _pipeline_id(strategy: tf.distribute.Strategy, pipelines: int) -> int:
  """This worker's input pipeline (its task id in a multi-worker cluster)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  task = getattr(resolver, "task_id", None) if resolver else None
  return int(task) if task is not None and 0 <= int(task) < pipelines else 0


def _local_replicas(strategy: tf.distribute.Strategy) -> int:
  """Replicas on this worker (1 for the default strategy)."""
  try:
    return max(len(strategy.extended.worker_devices), 1)
  except RuntimeError:
    return 1


InputData = ArrayData | DatasetData | DatasetFnData


def _check_element(dataset: tf.data.Dataset, what: str) -> None:
  spec = dataset.element_spec
  if not isinstance(spec, tuple) or len(spec) not in (2, 3):
    raise ValueError(
        f"{what} yields {type(spec).__name__} elements ({spec}); it must yield "
        "(x, y) or (x, y, sample_weight) tuples, batched (the Keras "
        "convention). Map it, e.g. ds.map(lambda d: (d['image'], "
        "d['label'])).")


def from_user(x: Any, y: Any = None, sample_weight: Any = None, *,
              what: str = "x", needs_targets: bool = True) -> InputData:
  """Classifies and checks a user's input (see the module docstring).

  Args:
    x: arrays (any nesting), a `tf.data.Dataset` or a dataset function.
    y: targets, for arrays only.
    sample_weight: per-example weights, for arrays only.
    what: the argument's name in errors (e.g. `"validation_data"`).
    needs_targets: arrays must come with `y` (training, evaluation).

  Raises:
    ValueError, TypeError: anything else, named.
  """
  if isinstance(x, tf.data.Dataset) or callable(x):
    if y is not None or sample_weight is not None:
      raise ValueError(
          f"{what}: y and sample_weight must be None when x is a "
          f"{'tf.data.Dataset' if isinstance(x, tf.data.Dataset) else 'dataset function'}"
          ": its elements carry them, as (x, y) or (x, y, sample_weight).")
    if isinstance(x, tf.data.Dataset):
      if needs_targets:
        _check_element(x, what)
      return DatasetData(x)
    return DatasetFnData(x)
  if x is None:
    raise ValueError(f"{what} is None; give arrays, a tf.data.Dataset or a "
                     "dataset function.")
  if isinstance(x, (collections.abc.Iterator, keras.utils.PyDataset)):
    raise TypeError(
        f"{what} is a {type(x).__name__}: tfmgpu takes arrays, a "
        "tf.data.Dataset or a dataset function (each replica's input is "
        "built from it). Wrap a generator in tf.data.Dataset.from_generator("
        "fn, output_signature=...), or pass the arrays themselves.")
  if y is None and needs_targets:
    raise ValueError(f"{what} is given as arrays without y; pass the targets "
                     "as y (or a tf.data.Dataset yielding (x, y)).")
  parts = [_as_structure(x, "x")]
  if y is not None:
    parts.append(_as_structure(y, "y"))
  if sample_weight is not None:
    parts.append(_as_structure(sample_weight, "sample_weight"))
  data = tuple(parts)
  _rows(data, what)
  return ArrayData(data)


def from_validation_data(validation_data: Any) -> InputData:
  """`validation_data` as Keras takes it: `(x, y)`, `(x, y, sample_weight)`,
  a dataset or a dataset function."""
  if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
    return from_user(*validation_data, what="validation_data")
  if isinstance(validation_data, (tuple, list)):
    raise ValueError(f"validation_data has {len(validation_data)} parts; give "
                     "(x_val, y_val), (x_val, y_val, sample_weight) or a "
                     "tf.data.Dataset.")
  return from_user(validation_data, what="validation_data")


def with_mask(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`(x, y[, sw])` batches as `(x, y, mask[, sw])` with a mask of ones."""
  def add(*batch):
    rows = tf.shape(tf.nest.flatten(batch[0])[0])[0]
    return (batch[0], batch[1], tf.ones([rows], tf.float32)) + tuple(batch[2:])
  return dataset.map(add)


def array_dataset_fn(data: tuple, *, global_batch_size: int,
                     order: np.ndarray | None, drop_remainder: bool,
                     repeat: bool = False):
  """`fn(input_context)` over in-memory arrays (the order of `epoch_order`:
  pipeline `i` takes every n-th row, batched per replica)."""
  if order is not None:
    data = tf.nest.map_structure(lambda a: a[order], data)

  def dataset_fn(ctx=None):
    per_replica = global_batch_size
    part = data
    if ctx is not None:
      per_replica = ctx.get_per_replica_batch_size(global_batch_size)
      if ctx.num_input_pipelines > 1:
        part = tf.nest.map_structure(
            lambda a: a[ctx.input_pipeline_id::ctx.num_input_pipelines], data)
    ds = tf.data.Dataset.from_tensor_slices(part)
    if repeat:
      ds = ds.repeat()
    ds = ds.batch(per_replica, drop_remainder=drop_remainder)
    return ds.prefetch(tf.data.AUTOTUNE)

  return dataset_fn


def distribute_arrays(strategy: tf.distribute.Strategy, data: tuple, *,
                      global_batch_size: int, order: np.ndarray | None = None,
                      drop_remainder: bool = True):
  """`array_dataset_fn(...)` distributed over `strategy`'s replicas."""
  check_global_batch(global_batch_size, strategy.num_replicas_in_sync)
  return strategy.distribute_datasets_from_function(array_dataset_fn(
      data, global_batch_size=global_batch_size, order=order,
      drop_remainder=drop_remainder))
