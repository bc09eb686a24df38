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

Batch arithmetic and the `tf.data` pipelines over arrays are
`tfmgpu.training.batches`' (`check_global_batch`, `epoch_order`,
`array_dataset_fn`, ...); this module re-exports them, so callers ask one
room about inputs.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfmgpu.training.batches import array_dataset_fn
from tfmgpu.training.batches import check_global_batch
from tfmgpu.training.batches import dataset_fn_from_step
from tfmgpu.training.batches import distribute_arrays
from tfmgpu.training.batches import epoch_indices
from tfmgpu.training.batches import epoch_order
from tfmgpu.training.batches import pad_rows
from tfmgpu.training.batches import with_mask

__all__ = [
    "INFINITE", "ArrayData", "DatasetData", "DatasetFnData", "InputData",
    "from_fit", "from_user", "from_validation_data",
    # Re-exported from `tfmgpu.training.batches`.
    "array_dataset_fn", "check_global_batch", "dataset_fn_from_step",
    "distribute_arrays", "epoch_indices", "epoch_order", "pad_rows",
    "with_mask",
]

INFINITE = -1


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
  if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
    raise TypeError(
        f"{what} is a {type(value).__name__}; arrays are batched as NumPy "
        "arrays. Give a dataset of batches instead: x=tf.data.Dataset."
        "from_tensor_slices((x, y)).batch(batch_size) (tfmgpu.predict takes "
        "it as it is).")
  if isinstance(value, (tf.data.Dataset, str, bytes)) or callable(value):
    raise TypeError(f"{what} is a {type(value).__name__}; inside arrays only "
                    "arrays are accepted (give a dataset as x alone).")
  to_numpy = getattr(value, "to_numpy", None) or getattr(value, "numpy", None)
  array = _strings_as_text(np.asarray(to_numpy() if to_numpy else value))
  if array.dtype == object:
    raise TypeError(f"{what} is not an array of numbers or strings (dtype "
                    f"object, shape {array.shape}); give a NumPy array, or a "
                    "dict, list or tuple of arrays for several inputs.")
  if array.ndim == 0:
    raise ValueError(f"{what} is a scalar ({array!r}); give one row per "
                     "example.")
  floatx = keras.backend.floatx()
  if array.dtype.kind == "f" and array.dtype != floatx:  # As Keras' fit:
    array = array.astype(floatx)  # NumPy's float64 targets failed a loss.
  return array


def _strings_as_text(array: np.ndarray) -> np.ndarray:
  """A string tensor's NumPy form (objects, each `bytes`) as a bytes array,
  which tf.data takes; other object arrays as they are."""
  if array.dtype != object or not array.size:
    return array
  for kind in (bytes, str):
    if all(isinstance(v, kind) for v in array.flat):
      return array.astype(kind)
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


def from_fit(x: Any, y: Any = None, sample_weight: Any = None,
             class_weight: Mapping[int, float] | None = None) -> InputData:
  """`from_user` for `fit`, with Keras' `class_weight`: each row weighted by
  the weight of its class (the integer label; a one-hot row's argmax; 1.0
  for a class not listed), given as its sample weight. As in Keras, only
  with a single `y` array (or a dataset of `(x, y)`) and no sample weights.

  Raises:
    ValueError, TypeError: see `from_user`; a `class_weight` that is not a
      dict of class ids, or one given with sample weights, several targets
      or a dataset function.
  """
  source = from_user(x, y, sample_weight)
  if class_weight is None:
    return source
  table = _class_weight_table(class_weight)
  targets = (source.data[1:] if isinstance(source, ArrayData) else
             source.dataset.element_spec[1:]
             if isinstance(source, DatasetData) else None)
  if targets is None:
    raise TypeError(
        "class_weight is for arrays or a tf.data.Dataset; x is a dataset "
        "function: yield (x, y, sample_weight) from it with sample_weight = "
        "tf.gather(weights, y).")
  if len(targets) != 1:
    raise ValueError("class_weight and sample_weight were both given; give "
                     "one (as Keras): multiply the class weights into "
                     "sample_weight, e.g. sample_weight * np.take(weights, y).")
  if isinstance(targets[0], (tuple, Mapping)):
    raise ValueError("class_weight is for a model with one output (as in "
                     "Keras); y has several. Pass sample_weight= instead.")
  if isinstance(source, DatasetData):
    return DatasetData(source.dataset.map(
        lambda x, y: (x, y, _row_class_weights(table, y))))
  return ArrayData(source.data + (
      _row_class_weights(table, tf.constant(source.data[1])).numpy(),))


def _class_weight_table(class_weight: Any) -> tf.Tensor:
  """`class_weight` as a float32 table by class id (1.0 where not given)."""
  if not isinstance(class_weight, Mapping) or not all(
      isinstance(k, (int, np.integer)) and k >= 0 for k in class_weight):
    raise ValueError(f"class_weight={class_weight!r} must be a dict from "
                     "class ids (ints >= 0) to weights, e.g. {0: 1.0, 1: 5.0}.")
  table = np.ones(max(class_weight, default=0) + 1, np.float32)
  for k, w in class_weight.items():
    table[int(k)] = float(w)
  return tf.constant(table)


def _row_class_weights(table: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
  """Each row's class weight (Keras': a row of several values is one-hot,
  its class the argmax; one value is a label, rounded)."""
  if y.shape.rank >= 2 and y.shape[-1] != 1:
    classes = tf.argmax(y, axis=-1, output_type=tf.int32)
  else:
    labels = tf.reshape(y, [-1]) if y.shape.rank >= 2 else y
    classes = tf.cast(tf.round(tf.cast(labels, tf.float32)), tf.int32)
  size = tf.shape(table, out_type=tf.int32)[0]
  known = (classes >= 0) & (classes < size)
  return tf.where(known, tf.gather(table, tf.clip_by_value(
      classes, 0, tf.maximum(size - 1, 0))), 1.0)


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
