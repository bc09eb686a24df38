"""Prepared shipped datasets, cached on disk as `.npz` files.

`cached(name, source, prepare)` returns `prepare()`'s arrays, read from
`cache_dir()` while `source` (what they are made from) is unchanged.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable

from absl import logging
import numpy as np

from tfmgpu import files

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


def cached(name: str, source: str,
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
  """Saves `x`, `y` to `path` whole or not at all (`files.write_atomically`)."""
  try:
    files.write_atomically(path, lambda f: np.savez(f, x=x, y=y))
  except OSError as e:
    logging.info("Not caching the prepared dataset in %s (%s); set "
                 "TFMGPU_CACHE_DIR to a writable directory to load it faster.",
                 os.path.dirname(path), e)
