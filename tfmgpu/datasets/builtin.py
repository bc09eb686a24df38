"""The built-in in-memory datasets: `digits`, `digits8x8`, `synthetic`, `npz`.

Each registers itself in `tfmgpu.datasets.registry` when this module is
imported (`tfmgpu.datasets` imports it).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
import zlib

import numpy as np

from tfmgpu.datasets.registry import Arrays
from tfmgpu.datasets.registry import check_features
from tfmgpu.datasets.registry import check_labels
from tfmgpu.datasets.registry import check_shapes
from tfmgpu.datasets.registry import not_class_indices
from tfmgpu.datasets.registry import register_dataset


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


_DATA_DIR = os.path.join(os.path.dirname(__file__), "data")


def shipped_digits(file_name: str) -> tuple[np.ndarray, np.ndarray]:
  """The uint8 `(x, y)` of a digits file that ships in `datasets/data/`.

  Written once by `scripts/make_shipped_digits.py`; licenses in
  `datasets/data/README.md`.
  """
  path = os.path.join(_DATA_DIR, file_name)
  try:
    with np.load(path) as f:
      return f["x"], f["y"]
  except FileNotFoundError as e:
    raise FileNotFoundError(
        f"The digits file {path!r} that ships inside tfmgpu is missing: the "
        "install is incomplete. Reinstall tfmgpu (pip install --force-"
        "reinstall tfmgpu, or pip install -e . from a checkout).") from e


@register_dataset("digits", "5,000 real 28x28 MNIST digits that ship inside "
                  "tfmgpu (offline; default).", options=("seed",))
def _digits(test_fraction: float = 0.2, seed: int = 0) -> Arrays:
  x, y = shipped_digits("mnist_5k.npz")
  return _split("digits", (x[..., None] / 255.0).astype(np.float32),
                y.astype(np.int32), test_fraction, seed)


@register_dataset("digits8x8", "1,797 real 8x8 UCI digits that ship inside "
                  "tfmgpu (offline).", options=("seed",))
def _digits8x8(test_fraction: float = 0.2, seed: int = 0) -> Arrays:
  x, y = shipped_digits("optdigits_8x8.npz")
  return _split("digits8x8", (x[..., None] / 16.0).astype(np.float32),
                y.astype(np.int32), test_fraction, seed)


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
                  "y_test (pass path=...): x as it is (float32), uint8 "
                  "images divided by 255.", options=("path",))
def npz(path: str | None = None) -> Arrays:
  """The `npz` dataset: the arrays of the `.npz` file at `path`."""
  if not path:
    raise ValueError("dataset 'npz' needs path='file.npz' (CLI: --data_path) "
                     "holding x_train, y_train, x_test, y_test.")
  if not os.path.exists(path):
    raise FileNotFoundError(f"dataset 'npz': path={path!r} does not exist.")
  x_train, y_train, x_test, y_test = _read_npz(path)
  for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    if len(x) != len(y):  # Said now, not after predicting every row.
      raise ValueError(
          f"dataset 'npz': {path!r} holds {len(x)} rows in x_{split} but "
          f"{len(y)} in y_{split}. Give one label per example: as many rows "
          f"in y_{split} as in x_{split}.")
  for name, y in (("y_train", y_train), ("y_test", y_test)):
    _check_class_indices(name, y, path)
  x_train, x_test = as_features(x_train, x_test, repr(path))
  y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
  arrays = Arrays("npz", x_train, y_train, x_test, y_test,
                  int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1)
  check_labels(arrays, source=repr(path))
  check_features(arrays, source=repr(path))
  check_shapes(arrays, source=repr(path))
  return arrays


def _check_class_indices(name: str, y: np.ndarray, path: str) -> None:
  """Raises a ValueError naming `name` unless `y` holds class indices (one
  per example, or per token): not one-hot rows, not real-valued targets."""
  other = ("; the npz dataset takes class indices only: for other targets "
           "(regression) give your own loader, --dataset=my_data.py:load "
           "returning ((x_train, y_train), (x_test, y_test)).")
  problem = not_class_indices(y)
  if problem is None:
    return
  if problem[0] == "one-hot":
    raise ValueError(
        f"dataset 'npz': {name} in {path!r} has shape {y.shape} and one 1 "
        "per row: one-hot labels. Save the class indices instead "
        f"({name}.argmax(axis=1)){other}")
  raise ValueError(f"dataset 'npz': {name} in {path!r} holds non-integer "
                   "labels; labels must be integer class indices "
                   f"0..num_classes-1{other}")


def _text_start(path: str) -> str | None:
  """The first characters of the file at `path` when it is text (not a
  zip archive such as .npz, nor a .npy array), else `None`."""
  with open(path, "rb") as f:
    head = f.read(64)
  if head[:2] in (b"PK", b"\x93N") or not head.strip():
    return None
  try:
    text = head.decode("utf-8")
  except UnicodeDecodeError:  # (A multi-byte character cut at 64 bytes
    return None               # is taken for binary: numpy's message.)
  if not all(c.isprintable() or c in "\t\r\n" for c in text):
    return None  # Zeros and control bytes decode too: binary.
  return text.splitlines()[0][:40]


def _read_npz(path: str) -> tuple[np.ndarray, ...]:
  """x_train, y_train, x_test, y_test of an .npz file; a damaged, empty or
  non-.npz file is named with its size."""
  def invalid(why: str) -> ValueError:
    return ValueError(
        f"dataset 'npz': path={path!r} is not a valid .npz file "
        f"({os.path.getsize(path)} bytes: {why}). Write it with "
        "numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...).")
  text = _text_start(path)
  if text is not None:  # numpy said "pickled (object) data" of text files.
    raise invalid(f"a text file, starting {text!r}; for CSV or other "
                  "text, give your own loader: --dataset=my_data.py:load")
  try:
    loaded = np.load(path, allow_pickle=False)
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    why = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else ""
    raise invalid(why or type(e).__name__) from e
  if not hasattr(loaded, "files"):
    raise invalid("one array (a .npy file), not an archive of named arrays")
  with loaded as f:
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test")
               if k not in f.files]
    if missing:
      raise ValueError(f"dataset 'npz': {path!r} lacks arrays {missing}; it has "
                       f"{f.files}.")
    try:
      return tuple(f[k] for k in ("x_train", "y_train", "x_test", "y_test"))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile,
            zlib.error) as e:
      raise invalid(str(e).strip().splitlines()[0] if str(e).strip()
                    else type(e).__name__) from e


def as_features(x_train: np.ndarray, x_test: np.ndarray,
                source: str) -> tuple[np.ndarray, np.ndarray]:
  """Both splits' features as float32: uint8 arrays (images, 0..255)
  divided by 255, with a channel axis added to 2-D ones (`(n, H, W)`), any
  other dtype used as it is (a float `(n, T, F)` is a sequence of
  features, not a grey image: it got a channel axis too, and a model
  built for `(T, F)` failed on `(T, F, 1)`; the convnet adds the axis to
  float grey images itself). Decided by dtype, the same for both splits:
  by the values, each split on its own, a float x_train above 1 was
  divided by 255 while an x_test below 1 was not.

  Raises:
    ValueError: one split uint8 and the other not (`source` names the
      file), which would scale them differently.
  """
  images = [x.dtype == np.uint8 for x in (x_train, x_test)]
  if images[0] != images[1]:
    raise ValueError(
        f"dataset {source}: x_train is {x_train.dtype} but x_test is "
        f"{x_test.dtype}; uint8 arrays (images 0..255) are divided by 255 "
        "and others used as they are, so the two splits would be scaled "
        "differently. Save both with the same dtype.")
  return tuple(_features(x, images[0]) for x in (x_train, x_test))


def _features(x: np.ndarray, image: bool) -> np.ndarray:
  if not image:
    return x.astype(np.float32)
  x = x.astype(np.float32) / 255.0
  return x[..., None] if x.ndim == 3 else x
