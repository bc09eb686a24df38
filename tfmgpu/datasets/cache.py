"""Where tfmgpu caches what it works out once per machine (`cache_dir`).

The autotuner keeps its choices there. The shipped digits need no cache: they
ship prepared inside the package (`datasets/data/`).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import os


def cache_dir() -> str:
  """Where tfmgpu caches what it works out once per machine.

  Returns:
    `$TFMGPU_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tfmgpu`, else
    `~/.cache/tfmgpu`.
  """
  if os.environ.get("TFMGPU_CACHE_DIR"):
    return os.environ["TFMGPU_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "tfmgpu")
