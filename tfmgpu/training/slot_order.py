"""The order a checkpoint's optimizer slots belong to, kept beside it.

A Keras optimizer checkpoints its slots (Adam's moments) as a list, in the
order of the variables it was built for; it restores them by position. A
run resumed in another layout (`rundir`: a ZeRO run resumed as a pipeline)
restores its weights by layer name (`portable`), but its slots only line up
when the new model lists its trainable variables in the same order: when
the order differs and the shapes happen to agree, the moments would land on
other weights without an error. The chief therefore writes the variables'
paths in order to `checkpoints/variables.txt`, and a resume whose model
lists the same paths in another order is refused. A variable split over
parameter servers (`variable_shards`) has slots per part, listed as
`path/part_0`, ...: a resume that splits it otherwise is refused too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from tfmgpu import _compat
from tfmgpu import files

FILE_NAME = "variables.txt"
_PART = re.compile(r"/part_\d+$")


class SlotOrderError(RuntimeError):
  """A checkpoint's optimizer slots belong to another variable order."""


def order_of(model: Any) -> list[str]:
  """The paths of `model`'s trainable variables, in the optimizer's order;
  one split over parameter servers as its parts' (`path/part_0`, ...)."""
  order = []
  for variable in model.trainable_variables:
    path = str(getattr(variable, "path", variable.name))
    parts = _compat.variable_shards(variable)
    order.extend([path] if parts is None else
                 [f"{path}/part_{i}" for i in range(len(parts))])
  return order


def write(directory: str, order: Sequence[str]) -> None:
  """Keeps `order` in `directory` (whole or not at all), if it changed."""
  path = os.path.join(directory, FILE_NAME)
  text = "".join(f"{p}\n" for p in order)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if f.read() == text:
        return
  files.write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def check(directory: str, order: Sequence[str]) -> None:
  """Raises `SlotOrderError` when the checkpoints in `directory` were saved
  for the same variables in another order (their slots would restore onto
  other weights). A missing file (older checkpoints) or other variables
  (another layout's shards, which fail to restore loudly) pass."""
  path = os.path.join(directory, FILE_NAME)
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    saved = f.read().splitlines()
  if saved == list(order):
    return
  _check_parts(directory, saved, order)
  if sorted(saved) != sorted(order):
    return
  first = next(i for i, (a, b) in enumerate(zip(saved, order)) if a != b)
  raise SlotOrderError(
      f"The checkpoints in {directory} hold optimizer slots for the model's "
      f"variables in another order (position {first}: {saved[first]!r} "
      f"then, {order[first]!r} now), as when a run is resumed in another "
      "layout: restored by position, Adam's moments would land on other "
      "weights. Resume in the layout the run was saved in, or start a new "
      "--model_dir from its weights (tfmgpu.restore_weights).")


def _check_parts(directory: str, saved: Sequence[str],
                 order: Sequence[str]) -> None:
  """Raises `SlotOrderError` when `saved` and `order` are the same variables
  split into other parts over parameter servers (`variable_shards`)."""
  def parts(paths):
    count: dict[str, int] = {}
    for p in paths:
      count[_PART.sub("", p)] = count.get(_PART.sub("", p), 0) + 1
    return count
  if not any(_PART.search(p) for p in [*saved, *order]):
    return  # No split variable: data copies repeat a path, not parts.
  then, now = parts(saved), parts(order)
  if list(then) != list(now):
    return
  name = next(n for n in then if then[n] != now[n])
  raise SlotOrderError(
      f"The checkpoints in {directory} hold optimizer slots for the model's "
      f"variables split otherwise over the parameter servers ({name!r}: "
      f"{then[name]} part(s) then, {now[name]} now): --variable_shards "
      "changed. Each part has slots of its own (Adam's moments), restored "
      "by position. Resume with the --variable_shards the run was saved "
      "with, or start a new --model_dir from its weights "
      "(tfmgpu.restore_weights).")


def other_variables(directory: str, order: Sequence[str]) -> str | None:
  """How the variables the checkpoints in `directory` were saved for
  differ from `order` in number (with the first path each side alone has),
  or `None` when they are as many (a model built again in one process may
  name its layers anew: `dense_1`), belong to other layers (another model:
  `rundir` names that mismatch), or nothing was recorded."""
  path = os.path.join(directory, FILE_NAME)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    saved = f.read().splitlines()
  layers = lambda paths: {p.split("/")[0] for p in paths}
  if len(saved) == len(order) or layers(saved) != layers(order):
    return None  # The same variables, or another model's.
  then = [p for p in saved if p not in set(order)]
  now = [p for p in order if p not in set(saved)]
  return (f"{len(saved)} variables then, {len(order)} now"
          + (f"; only then: {then[0]!r}" if then else "")
          + (f"; only now: {now[0]!r}" if now else ""))


def moved_error(directory: str, difference: str) -> SlotOrderError:
  """The error of a resume whose model holds other variables than the
  checkpoints' optimizer slots were saved for."""
  return SlotOrderError(
      f"The checkpoints in {directory} hold optimizer slots for other "
      f"variables than this run's model ({difference}), as when a run "
      "moves between layouts that split weights into shards or copy them "
      "(tensor or data parallelism): the weights would restore by layer "
      "name, but the optimizer's slots (Adam's moments) cannot follow. "
      "Resume in the layout the run was saved in, or start a new "
      "--model_dir from its weights (tfmgpu.restore_weights). The "
      "checkpoints are left as they are.")

