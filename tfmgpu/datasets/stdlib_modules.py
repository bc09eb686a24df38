"""`stdlib_modules`: which standard-library module a window of source is from.

Text classification on the same offline text as `stdlib_text` (the source
of its `MODULES`, read from this interpreter's `stdlib` directory): `x` is a
window of `seq_len` bytes (int32 byte values, vocabulary 256), `y` the index
of the module it comes from in `text.MODULES` (12 classes: `argparse`,
`difflib`, ...). Each module's first 90% of bytes give training windows and
its last 10% validation windows (non-overlapping), so no byte is in both
splits. Training rows are shuffled with the run's seed (the modules come in
order otherwise); validation rows stay in module order.

It is what the `bert` registry model trains on: a bidirectional encoder
classifying a text, with data that ships with Python. Predicting the
largest module (`argparse`) everywhere scores `majority_accuracy`.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tfmgpu.datasets import registry as data_lib
from tfmgpu.datasets import text

NAME = "stdlib_modules"
DEFAULT_SEQ_LEN = 64


def _windows(source: bytes, seq_len: int) -> np.ndarray:
  raw = np.frombuffer(source, np.uint8)
  n = len(raw) // seq_len
  return raw[:n * seq_len].astype(np.int32).reshape(n, seq_len)


def majority_accuracy(y_train: np.ndarray, y_test: np.ndarray) -> float:
  """Accuracy on `y_test` of always predicting `y_train`'s commonest class."""
  return float(np.mean(y_test == np.bincount(y_train).argmax()))


def load(seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0,
         validation_fraction: float = text.VALIDATION_FRACTION
         ) -> data_lib.Arrays:
  """The `stdlib_modules` dataset.

  Args:
    seq_len: bytes per example `T`. Defaults to 64.
    seed: the order of the training rows.
    validation_fraction: the last fraction of each module's bytes that
      validates.

  Returns:
    `data.Arrays` of `(n, T)` int32 bytes and int32 module indices, with
    `len(text.MODULES)` classes.

  Raises:
    ValueError: `seq_len` is not a positive int or leaves a module no
      validation window.
    data.DatasetUnavailableError: the standard-library sources are missing.
  """
  if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
    raise ValueError(f"seq_len={seq_len!r} must be a positive int.")
  parts: dict[str, list[np.ndarray]] = {"xtr": [], "ytr": [], "xte": [],
                                        "yte": []}
  for label, source in enumerate(text.module_sources()):
    cut = text.split_point(len(source), validation_fraction)
    train, test = _windows(source[:cut], seq_len), _windows(source[cut:],
                                                            seq_len)
    if not len(test):
      raise ValueError(
          f"seq_len={seq_len} is longer than the validation part of module "
          f"{text.MODULES[label]!r} ({len(source) - cut} bytes); use a "
          "shorter one.")
    for key, rows in (("xtr", train), ("xte", test)):
      parts[key].append(rows)
      parts["y" + key[1:]].append(np.full(len(rows), label, np.int32))
  x_train, y_train = (np.concatenate(parts["xtr"]),
                      np.concatenate(parts["ytr"]))
  order = np.random.default_rng([seed, 0x5d1b]).permutation(len(x_train))
  return data_lib.Arrays(NAME, x_train[order], y_train[order],
                         np.concatenate(parts["xte"]),
                         np.concatenate(parts["yte"]), len(text.MODULES))


@data_lib.register_dataset(
    NAME, "Text classification: which of 12 standard-library modules a "
    "window of its Python source comes from (offline; the bytes of "
    "stdlib_text, split per module).", options=("seed",))
def _stdlib_modules(seq_len: int | None = None, seed: int = 0
                    ) -> data_lib.Arrays:
  return load(seq_len=seq_len or DEFAULT_SEQ_LEN, seed=seed)
