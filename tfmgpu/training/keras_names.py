"""Keras' names for what a `Trainer` call takes under its own, said as such.

A Keras user types `trainer.fit(x, y, batch_size=32)` first; Python's
"unexpected keyword argument 'batch_size'" does not say that tfmgpu's batch
is `global_batch_size`, or that callbacks and verbosity are the Trainer's
settings. `explain_keras_names` wraps `fit` and `evaluate` so that these
names are refused with what to write instead, the value echoed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

# A Keras argument -> what to write instead (`{value!r}`: the value given).
INSTEAD = {
    # Under a strategy Keras' batch_size is the global batch too.
    "batch_size": "global_batch_size={value!r} (examples per step over all "
                  "replicas)",
    "callbacks": "Trainer(model, callbacks={value!r}, ...)",
    "verbose": "Trainer(model, verbose={value!r}, ...)",
    # Keras holds out the last rows, before shuffling.
    "validation_split": "fit(x[:k], y[:k], validation_data=(x[k:], y[k:]), "
                        "...) with k = int(len(x) * (1 - {value!r})): the "
                        "rows Keras' validation_split holds out",
    "initial_epoch": "Trainer(model, model_dir=DIR, ...): a run resumes at "
                     "the epoch its checkpoints in DIR hold",
    "validation_steps": "validation_data of the rows to evaluate, read "
                        "whole each epoch (a repeated dataset: "
                        "dataset.take({value!r}))",
    "validation_batch_size": "validation_data evaluated at fit's "
                             "global_batch_size",
    "validation_freq": "validation_data, evaluated after every epoch",
    "steps": "steps_per_epoch={value!r} in fit; in evaluate, x of the rows "
             "to evaluate, read whole (a repeated dataset: "
             "dataset.take({value!r}))",
    "return_dict": "nothing: evaluate() returns a dict already",
}
METHODS = ("fit", "evaluate")

_Class = TypeVar("_Class", bound=type)


def refuse(method: str, given: dict[str, Any]) -> None:
  """Raises `TypeError` for the first of `given` that is one of Keras'
  names in `INSTEAD`, saying what `method` takes instead."""
  for name, value in given.items():
    if name in INSTEAD:
      raise TypeError(
          f"{method}() got {name}={value!r}, Keras' name: tfmgpu's Trainer "
          f"takes {INSTEAD[name].format(value=value)}.")


def explain_keras_names(cls: _Class) -> _Class:
  """Class decorator: `cls.fit` and `cls.evaluate` refuse Keras' names they
  do not take (`refuse`) before Python's bare `TypeError`."""
  for method in METHODS:
    setattr(cls, method, _checked(cls.__dict__[method], cls.__name__))
  return cls


def _checked(function: Callable[..., Any], owner: str) -> Callable[..., Any]:
  takes = set(inspect.signature(function).parameters)
  name = f"{owner}.{function.__name__}"

  @functools.wraps(function)
  def call(self, *args, **kwargs):
    refuse(name, {k: v for k, v in kwargs.items() if k not in takes})
    return function(self, *args, **kwargs)
  return call
