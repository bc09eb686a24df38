"""Strings given to a model that takes none, refused before any step.

A keras_hub task built with a preprocessor takes text in its own `fit` and
`predict`, which run the preprocessor over the data first; its `call`,
which tfmgpu's steps, `tfmgpu.predict` and every split run, takes what the
preprocessor makes (token ids, masks). Given the strings, the Trainer and
`predict` failed deep in the traced step with keras_hub's "Use
model.predict(x), model.fit(x, y)" (which tfmgpu's user did), and a split's
`fit` with Keras' "Invalid dtype: str864". The check runs where the inputs
meet the model: `Trainer.fit` (`SyncExecution.plan`), evaluation,
`inference.Predictor` and a placed model's own `fit`/`evaluate`/`predict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tfmgpu.parallel import graph as graph_lib
from tfmgpu.training import inputs


def check_source(model: Any, source: inputs.InputData) -> None:
  """`check(model, x)` for a `Trainer`'s input (arrays or a dataset; a
  dataset function is read only in the step)."""
  if isinstance(source, inputs.ArrayData):
    check(model, source.x)
  elif isinstance(source, inputs.DatasetData):
    check(model, source.dataset)


def check(model: Any, x: Any, what: str = "x") -> None:
  """Raises when `x` (arrays in any nesting, or a `tf.data.Dataset`) holds
  strings and `model` takes no string input.

  Raises:
    TypeError: naming where the strings are, the model's input dtypes, and
      how to preprocess them (a keras_hub task's `preprocessor`).
  """
  strings = _string_paths(x, what)
  dtypes = graph_lib.input_dtypes(model)
  if not strings or not dtypes or "string" in dtypes:
    return
  name = getattr(model, "name", type(model).__name__)
  preprocessor = getattr(model, "preprocessor", None)
  how = ("pass x = model.preprocessor(x) (arrays), or map it over the "
         "tf.data dataset (dataset.map(model.preprocessor)), as keras_hub's "
         "own fit and predict do" if preprocessor is not None else
         "turn them into the model's inputs first (for a keras_hub task: "
         "task.preprocessor(x), or dataset.map(task.preprocessor))")
  raise TypeError(
      f"{strings[0]} holds strings, but model {name!r} takes inputs of "
      f"dtype {', '.join(dtypes)}: tfmgpu runs the model's call on the data "
      f"as given, without a preprocessor. To train or predict on text, "
      f"{how}.")


def _string_paths(x: Any, what: str) -> list[str]:
  """Where `x` holds strings (a dataset's element spec is looked at)."""
  if isinstance(x, tf.data.Dataset):
    x, what = x.element_spec, f"{what}'s elements"
  return [path for path, leaf in _leaves(x, what) if _is_string(leaf)]


def _leaves(value: Any, path: str):
  if isinstance(value, Mapping):
    for k, v in value.items():
      yield from _leaves(v, f"{path}[{k!r}]")
  elif isinstance(value, (list, tuple)) and not all(
      isinstance(v, (str, bytes)) for v in value):
    for i, v in enumerate(value):
      yield from _leaves(v, f"{path}[{i}]")
  else:
    yield path, value


def _is_string(leaf: Any) -> bool:
  """Text: Python strings, a NumPy array of them, a string tensor or spec."""
  if isinstance(leaf, (str, bytes)):
    return True
  if isinstance(leaf, (list, tuple)):  # Only strings (see `_leaves`).
    return bool(leaf)
  dtype = getattr(leaf, "dtype", None)
  if isinstance(dtype, np.dtype):
    return dtype.kind in "US" or (
        dtype.kind == "O" and leaf.size > 0
        and isinstance(np.asarray(leaf).flat[0], (str, bytes)))  # pandas
  return dtype == tf.string
