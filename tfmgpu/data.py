"""Datasets by name (`tfmgpu.datasets`, re-exported).

The registry, `Arrays` and the built-in datasets live in the
`tfmgpu.datasets` package; this module keeps their names importable as
`tfmgpu.data.*`. Batch arithmetic (`check_global_batch`, `epoch_order`) and
the per-replica pipeline (seeded shuffle, global batch, shard per input
pipeline, prefetch) are `tfmgpu.training.batches`' (re-exported by
`tfmgpu.training.inputs`).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from tfmgpu.datasets.cache import cache_dir
from tfmgpu.datasets.registry import Arrays
from tfmgpu.datasets.registry import available_datasets
from tfmgpu.datasets.registry import Baseline
from tfmgpu.datasets.registry import check_dataset
from tfmgpu.datasets.registry import check_features
from tfmgpu.datasets.registry import check_labels
from tfmgpu.datasets.registry import check_labels_for_default_loss
from tfmgpu.datasets.registry import check_shapes
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
    "check_features", "check_labels", "check_labels_for_default_loss",
    "check_shapes", "dataset_entry",
    "DatasetEntry", "DatasetUnavailableError", "default_metrics", "load_dataset",
    "open_dataset", "register_dataset", "StreamedDataset",
    "unregister_dataset", "USER_LOADER_CALL", "user_arrays", "user_datasets",
    "UserDatasets"]
