"""Datasets that `keras.datasets` downloads: `mnist`, `fashion_mnist`, `cifar10`.

Each registers itself in `tfmgpu.datasets.registry` when this module is
imported; offline, each reads the same arrays from an `.npz` (`path=`).

Importing this module does not import TensorFlow (a load imports Keras).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tfmgpu.datasets import builtin
from tfmgpu.datasets.registry import Arrays
from tfmgpu.datasets.registry import DatasetUnavailableError
from tfmgpu.datasets.registry import register_dataset


def _keras_dataset(name: str) -> Callable[..., Arrays]:
  def load(path: str | None = None) -> Arrays:
    if path:  # Images whatever their dtype: (n, H, W) gets its channel.
      arrays = builtin.npz(path)
      if arrays.x_train.ndim == 3:
        return dataclasses.replace(arrays, name=name,
                                   x_train=arrays.x_train[..., None],
                                   x_test=arrays.x_test[..., None])
      return dataclasses.replace(arrays, name=name)
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
    x_train, x_test = builtin.as_features(x_train, x_test, repr(name))
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
