"""`stdlib_text`: byte-level language modelling on the Python standard library.

Text that is on every machine with Python, offline: the source of a fixed
list of pure-Python standard-library modules (`MODULES`, about 500 KB),
read from the interpreter's own `stdlib` directory (never via `import`, so
a module of the same name elsewhere on the path is not read) and
concatenated in that order. The SHA-256 of the bytes is recorded for the
Python versions they were checked on (`SOURCE_SHA256`); another version
may ship slightly different sources, which is logged as a warning with both
hashes, and the data is used all the same.

Examples are non-overlapping windows of `seq_len` bytes: `x = b[i:i+T]`,
`y = b[i+1:i+T+1]` (int32 byte values; `num_classes` 256). The split is
fixed, never shuffled across: the first 90% of the bytes train, the last
10% validate (the `Arrays` test split). `unigram_bits_per_byte` is the
baseline a model must beat: the bits per byte of the training bytes'
frequencies (add-one smoothing) on the validation targets, attached to the
`Arrays` as a `data.Baseline` so that a run's summary prints it next to the
model's `bits_per_byte`.

With `padding_mask="ones"` or `"ragged"`, `x` is
`{"tokens": ..., "padding_mask": ...}` (1 = real token, 0 = padding) for a
model with a padding-mask input (`gpt`); see `load`.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig

from absl import logging
import numpy as np

from tfmgpu.datasets import registry as data_lib

NAME = "stdlib_text"

# Stable, sizeable pure-Python modules, read in this order.
MODULES = ("argparse", "difflib", "textwrap", "pprint", "fractions", "heapq",
           "statistics", "shlex", "calendar", "configparser", "optparse",
           "csv")

# SHA-256 of the concatenated bytes, by the Python version checked.
SOURCE_SHA256 = {
    "3.11.7": "f6de6db0e27053849c27ec072677680ab699f4e2bfcd2f9f082ce61b0962b448",
}

VALIDATION_FRACTION = 0.1
DEFAULT_SEQ_LEN = 64
PADDING_MASK_CHOICES = ("none", "ones", "ragged")
VOCAB_SIZE = 256


def stdlib_dir() -> str:
  """The interpreter's standard-library directory (`sysconfig`'s `stdlib`)."""
  return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=1)
def module_sources() -> tuple[bytes, ...]:
  """The source of each of `MODULES`, in order (read once).

  Raises:
    data.DatasetUnavailableError: a module's `.py` source is not installed
      (some distributions ship only compiled files); the path is named.
  """
  parts = []
  for module in MODULES:
    path = os.path.join(stdlib_dir(), *module.split(".")) + ".py"
    try:
      with open(path, "rb") as f:
        parts.append(f.read())
    except OSError as e:
      raise data_lib.DatasetUnavailableError(
          f"dataset {NAME!r} reads the standard library's source and "
          f"{path} cannot be read ({e.strerror or e}). Install this "
          "Python's standard-library sources (e.g. the python3.x package "
          "rather than a minimal one).") from e
  return tuple(parts)


def source_bytes() -> bytes:
  """The `MODULES`' source files concatenated, in order (see
  `module_sources`)."""
  return b"".join(module_sources())


def check_source_hash(source: bytes) -> bool:
  """Compares `source`'s SHA-256 with the one recorded for this Python.

  Returns:
    True if it matches; False (after logging a warning with both hashes)
    if it differs or no hash is recorded for this version: training goes
    on, on the bytes this Python has.
  """
  version = platform.python_version()
  digest = hashlib.sha256(source).hexdigest()
  expected = SOURCE_SHA256.get(version)
  if expected == digest:
    return True
  recorded = ", ".join(f"Python {v}: {h}" for v, h in SOURCE_SHA256.items())
  logging.warning(
      "dataset %r: the standard-library source bytes of Python %s have "
      "SHA-256 %s; %s (recorded: %s). This Python ships different sources, "
      "so results (bits per byte, the baseline) are not comparable with "
      "runs on the recorded version.", NAME, version, digest,
      "it differs" if expected else "no hash is recorded for this version",
      recorded)
  return False


def split_point(num_bytes: int,
                validation_fraction: float = VALIDATION_FRACTION) -> int:
  """Index of the first validation byte: the last `validation_fraction`."""
  return num_bytes - int(num_bytes * validation_fraction)


def windows(source: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping `(x, y)` windows: `x = b[i:i+T]`, `y = b[i+1:i+T+1]`.

  Args:
    source: uint8 bytes.
    seq_len: `T`.

  Returns:
    int32 `x` and `y` of shape `(n, T)`, `n = (len(source) - 1) // T`.
  """
  n = (len(source) - 1) // seq_len
  tokens = source[:n * seq_len + 1].astype(np.int32)
  return (tokens[:-1].reshape(n, seq_len).copy(),
          tokens[1:].reshape(n, seq_len).copy())


def unigram_bits_per_byte(train: np.ndarray, targets: np.ndarray) -> float:
  """Bits per byte of the byte-unigram model of `train` on `targets`.

  The model predicts every byte with the training bytes' frequencies,
  add-one smoothed over the 256 values: `p(b) = (count(b) + 1) / (n + 256)`.

  Args:
    train: the training bytes (any integer array of values 0..255).
    targets: the bytes to predict (e.g. the validation `y`).

  Returns:
    `-mean(log2 p(targets))`.
  """
  counts = np.bincount(np.ravel(train), minlength=VOCAB_SIZE) + 1.0
  log_p = np.log2(counts / counts.sum())
  return float(-log_p[np.ravel(targets)].mean())


def _ragged_mask(x: np.ndarray, y: np.ndarray, seed: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Left-pads every other row by a seeded 1..T/2 positions.

  A padded row keeps its first `T - k` tokens and targets, shifted right by
  `k`: its first `k` tokens and targets are 0, with mask 0.
  """
  x, y = x.copy(), y.copy()
  mask = np.ones_like(x)
  rng = np.random.default_rng([seed, 0x7e47])
  seq_len = x.shape[1]
  for row in range(0, len(x), 2):
    k = int(rng.integers(1, max(seq_len // 2, 1) + 1))
    for array in (x, y):
      array[row, k:] = array[row, :seq_len - k].copy()
      array[row, :k] = 0
    mask[row, :k] = 0
  return x, y, mask


def load(seq_len: int = DEFAULT_SEQ_LEN, padding_mask: str = "none",
         seed: int = 0, validation_fraction: float = VALIDATION_FRACTION
         ) -> data_lib.Arrays:
  """The `stdlib_text` dataset.

  Args:
    seq_len: bytes per example `T`. Defaults to 64.
    padding_mask: `"none"`: `x` is the `(n, T)` tokens; `"ones"`: `x` is
      `{"tokens", "padding_mask"}` with an all-ones mask (same data, the
      mask path exercised); `"ragged"`: as `"ones"`, but every other
      training row is left-padded by a seeded 1..T/2 positions (token and
      target 0, mask 0; see `_ragged_mask`), which a model's padding mask
      must hide from the real tokens. Validation rows are never padded.
    seed: the ragged variant's padding lengths.
    validation_fraction: the last fraction of the bytes that validates.

  Returns:
    `data.Arrays` (the test split is the validation split), carrying the
    byte-unigram baseline (`Arrays.baselines`).

  Raises:
    ValueError: a bad option (named, with the allowed values).
    data.DatasetUnavailableError: the standard-library sources are missing.
  """
  if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
    raise ValueError(f"seq_len={seq_len!r} must be a positive int.")
  if padding_mask not in PADDING_MASK_CHOICES:
    raise ValueError(f"padding_mask={padding_mask!r} is not one of "
                     f"{', '.join(PADDING_MASK_CHOICES)}.")
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"validation_fraction={validation_fraction!r} must be "
                     "in (0, 1).")
  source = source_bytes()
  check_source_hash(source)
  raw = np.frombuffer(source, np.uint8)
  cut = split_point(len(raw), validation_fraction)
  x_train, y_train = windows(raw[:cut], seq_len)
  x_test, y_test = windows(raw[cut:], seq_len)
  if not len(x_test):
    raise ValueError(f"seq_len={seq_len} is longer than the validation "
                     f"split ({len(raw) - cut} bytes); use a shorter one.")
  baseline = data_lib.Baseline(
      name="byte-unigram", metric="bits_per_byte",
      value=unigram_bits_per_byte(raw[:cut], y_test))
  if padding_mask != "none":
    mask_train = np.ones_like(x_train)
    if padding_mask == "ragged":
      x_train, y_train, mask_train = _ragged_mask(x_train, y_train, seed)
    x_train = {"tokens": x_train, "padding_mask": mask_train}
    x_test = {"tokens": x_test, "padding_mask": np.ones_like(x_test)}
  return data_lib.Arrays(NAME, x_train, y_train, x_test, y_test, VOCAB_SIZE,
                         baselines=(baseline,))


@data_lib.register_dataset(
    "stdlib_text", "Byte-level language modelling on ~500 KB of the Python "
    "standard library's own source (offline; next-byte targets, a fixed "
    "validation split).", options=("seed",),
    metrics=("bits_per_byte", "perplexity", "accuracy"))
def _stdlib_text(seq_len: int | None = None, padding_mask: str = "none",
                 seed: int = 0) -> data_lib.Arrays:
  return load(seq_len=seq_len or DEFAULT_SEQ_LEN, padding_mask=padding_mask,
              seed=seed)
