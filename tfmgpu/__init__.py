"""tfmgpu: train and serve Keras models on many devices.

The public API, one name per line. Names resolve on first use so that
`import tfmgpu` (and every CLI's `--help`) stays fast and TensorFlow loads
only when something needs it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from tfmgpu import tf_logs as _tf_logs

__version__ = "0.1.0"

# TF's C++ start-up lines are hidden unless the user set
# TF_CPP_MIN_LOG_LEVEL (`tfmgpu.tf_logs`).
_tf_logs.quiet_by_default()

_EXPORTS = {
    "quiet_tensorflow": "tfmgpu.tf_logs",  # Loads TF without its C++ start-up lines.
    "DeviceConfigurationError": "tfmgpu.devices",
    "DeviceLayout": "tfmgpu.devices",
    "configure_devices": "tfmgpu.devices",
    "configure_virtual_devices": "tfmgpu.devices",
    "list_devices": "tfmgpu.devices",
    "available_strategies": "tfmgpu.strategies",
    "get_strategy": "tfmgpu.strategies",
    "TrainConfig": "tfmgpu.config",
    "run_training": "tfmgpu.runs",
    "available_datasets": "tfmgpu.data",
    "load_dataset": "tfmgpu.data",
    "available_models": "tfmgpu.models",
    "build_model": "tfmgpu.models",
    "Trainer": "tfmgpu.training.loop",
    "TrainerOptions": "tfmgpu.training.trainer_options",
    "predict": "tfmgpu.predict",  # The CLI module, callable as the function.
    "Predictor": "tfmgpu.inference",
    "generate": "tfmgpu.generate",  # The CLI module, callable as the function.
    "Generator": "tfmgpu.generation",
    "export_saved_model": "tfmgpu.inference",
    "load_model": "tfmgpu.inference",
    "plan_stages": "tfmgpu.parallel.partition",
    "StagePlan": "tfmgpu.parallel.plan",
    "StagedModel": "tfmgpu.parallel.staged",
    "PipelinedModel": "tfmgpu.parallel.pipeline",
    "BranchParallel": "tfmgpu.parallel.branches",
    "ShardedModel": "tfmgpu.parallel.zero",
    "simulate_pipeline": "tfmgpu.parallel.timeline",
    "ParameterServerTrainer": "tfmgpu.training.parameter_server",
    "PreemptedError": "tfmgpu.training.checkpoints",
    "EXIT_PREEMPTED": "tfmgpu.training.checkpoints",
}

# Public names that differ from the name in their module.
_RENAMED = {"simulate_pipeline": "simulate"}

__all__ = sorted(_EXPORTS)


def _submodules() -> list[str]:
  """The public submodules and subpackages (`tfmgpu.models`, ...)."""
  return sorted(m.name for m in pkgutil.iter_modules(__path__)
                if not m.name.startswith("_"))


# Modules that moved into `tfmgpu.datasets`: `from tfmgpu import tfrecord`
# still finds them.
_MOVED = {"tfrecord": "tfmgpu.datasets.tfrecord",
          "text": "tfmgpu.datasets.text"}


def __getattr__(name: str) -> Any:
  if name in _MOVED:
    return importlib.import_module(_MOVED[name])
  if name not in _EXPORTS:
    if name in _submodules():  # `tfmgpu.models.custom_objects()` works
      return importlib.import_module(f"{__name__}.{name}")  # after import.
    raise AttributeError(f"module 'tfmgpu' has no attribute {name!r}")
  module = importlib.import_module(_EXPORTS[name])
  if module.__name__ == f"{__name__}.{name}":
    return module  # A submodule of the same name (`tfmgpu.predict`, ...).
  value = getattr(module, _RENAMED.get(name, name))
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__) | set(_submodules()))
