"""A module proxy that imports on first attribute access.

The CLIs list registry names (strategies, models, datasets) in their flag
definitions, and `--help` must answer before TensorFlow loads; modules that
hold a registry refer to TensorFlow through this proxy.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
  """Stands in for `name` until an attribute is read, then imports it."""

  def __init__(self, name: str):
    super().__init__(name)
    self._lazy_name = name

  def __getattr__(self, attr: str) -> Any:
    module = importlib.import_module(self._lazy_name)
    return getattr(module, attr)
