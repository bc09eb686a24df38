"""Datasets by name: the registry and the built-in datasets.

* `registry`: `Arrays`, `register_dataset`, `load_dataset`, `open_dataset`,
  the user's loader; the only list of dataset names (the CLI's `--dataset`
  choices come from it).
* `builtin`: `digits` (the default) and `digits8x8` (shipped in `data/`),
  `synthetic`, `npz`;
  `cache`: `cache_dir`, where tfmgpu caches per-machine choices.
* `tfrecord`: TFRecord shards, written by `scripts/write_tfrecords.py` and
  streamed per worker (`tfrecord`).
* `text`: `stdlib_text`, byte-level language modelling;
  `stdlib_modules`: which module a window of the same text is from.
* `downloads`: `mnist`, `fashion_mnist`, `cifar10` from `keras.datasets`.

Each built-in module registers its datasets when imported; importing this
package imports them all (in the order the CLI lists them), and no module
imports a dataset module back. `tfmgpu.data` re-exports the registry's
names. Importing this package does not import TensorFlow.
"""

from __future__ import annotations

from tfmgpu.datasets import registry
from tfmgpu.datasets import builtin  # Registers digits, ..., npz.
from tfmgpu.datasets import tfrecord  # Registers tfrecord.
from tfmgpu.datasets import text  # Registers stdlib_text.
from tfmgpu.datasets import stdlib_modules  # Registers stdlib_modules.
from tfmgpu.datasets import downloads  # Registers mnist, ..., cifar10.

__all__ = ["builtin", "downloads", "registry", "stdlib_modules", "text",
           "tfrecord"]
