"""How a model is spread over devices: stage plans, staged models, pipelines, branches.

Its placement names ("model_parallel", "branch_parallel", "pipeline") are
registered in `tfmgpu.strategies`, the one list of names. Importing this
package does not import TensorFlow: the public names below resolve on first
use, like `tfmgpu`'s own.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BranchParallel": "tfmgpu.parallel.branches",
    "PipelinedModel": "tfmgpu.parallel.pipeline",
    "StagePlan": "tfmgpu.parallel.partition",
    "StagedModel": "tfmgpu.parallel.staged",
    "Timeline": "tfmgpu.parallel.schedule",
    "plan_stages": "tfmgpu.parallel.partition",
    "simulate": "tfmgpu.parallel.schedule",
    "theoretical_bubble": "tfmgpu.parallel.schedule",
}
_SUBMODULES = ("branches", "demo_models", "partition", "pipeline", "schedule",
               "staged")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _SUBMODULES:
    return importlib.import_module(f"tfmgpu.parallel.{name}")
  if name not in _EXPORTS:
    raise AttributeError(f"module 'tfmgpu.parallel' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__ + list(_SUBMODULES))
