"""Datasets by name (`tfmgpu.datasets`, re-exported) and batch arithmetic.

The registry, `Arrays` and the built-in datasets live in the
`tfmgpu.datasets` package; this module keeps their names importable as
`tfmgpu.data.*`. `tfmgpu.training.inputs` builds the per-replica pipeline
(seeded shuffle, global batch, shard per input pipeline, prefetch).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tfmgpu import checks
from tfmgpu.datasets.cache import cache_dir
from tfmgpu.datasets.registry import Arrays
from tfmgpu.datasets.registry import available_datasets
from tfmgpu.datasets.registry import Baseline
from tfmgpu.datasets.registry import check_dataset
from tfmgpu.datasets.registry import check_labels
from tfmgpu.datasets.registry import dataset_entry
from tfmgpu.datasets.registry import DatasetEntry
from tfmgpu.datasets.registry import DatasetUnavailableError
from tfmgpu.datasets.registry import default_metrics
from tfmgpu.datasets.registry import load_dataset
from tfmgpu.datasets.registry import open_dataset
from tfmgpu.datasets.registry import register_dataset
from tfmgpu.datasets.registry import StreamedDataset
from tfmgpu.datasets.registry import unregister_dataset
from tfmgpu.datasets.registry import USER_LOADER_CALL
from tfmgpu.datasets.registry import user_arrays
from tfmgpu.datasets.registry import user_datasets
from tfmgpu.datasets.registry import UserDatasets

__all__ = [
    "Arrays", "available_datasets", "Baseline", "cache_dir", "check_dataset",
    "check_global_batch", "check_labels", "dataset_entry", "DatasetEntry",
    "DatasetUnavailableError", "default_metrics", "epoch_indices",
    "epoch_order", "load_dataset", "open_dataset", "register_dataset",
    "StreamedDataset", "unregister_dataset", "USER_LOADER_CALL",
    "user_arrays", "user_datasets", "UserDatasets"]


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
