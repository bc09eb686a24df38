"""Whether checkpoints that do not restore are damaged or another run's.

A checkpoint fails to restore when its files are damaged, and also when
they are whole but hold another model's weights or another optimizer's
slots (a notebook resumed with SGD over an Adam run's `model_dir`). The
two need opposite advice: restore the files from a copy, or use another
`model_dir`. `reads_back_whole` reads every tensor (their checksums catch
a flipped byte); `differences` names the first variables whose shapes
differ between the checkpoint and this run's optimizer (which lists the
model's trainable weights it was built for, then its own).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmgpu import _compat

_OPTIMIZER = "optimizer"  # The optimizer's name in a tfmgpu checkpoint.


def reads_back_whole(path: str) -> bool:
  """Every tensor of checkpoint `path` reads back (checksums agree)."""
  try:
    reader = tf.train.load_checkpoint(path)
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
  except Exception:  # pylint: disable=broad-except
    return False  # TF maps damage to many errors: each means "damaged".
  return True


def _shape(shape: Any) -> str:
  return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") \
      + ")"


def differences(path: str, optimizer: Any, limit: int = 3) -> list[str]:
  """The first `limit` variables whose shape differs between checkpoint
  `path` and this run's optimizer (the model's weights, then the slots),
  and how many each side holds when their numbers differ."""
  lists = (f"{_OPTIMIZER}/_trainable_variables/", f"{_OPTIMIZER}/_variables/")
  saved = {k: tuple(s) for k, s in tf.train.load_checkpoint(
      path).get_variable_to_shape_map().items() if k.startswith(lists)}
  ours = _compat.optimizer_checkpoint_keys(optimizer, _OPTIMIZER)
  found = []
  for key, (shape, name) in ours.items():
    if key not in saved:
      found.append(f"{name!r} {_shape(shape)} is not in it")
    elif saved[key] != shape:
      found.append(f"{name!r} is {_shape(shape)} here, "
                   f"{_shape(saved[key])} there")
  found = found[:limit]
  if len(saved) != len(ours):
    found.append(f"it holds {len(saved)} weights and optimizer variables, "
                 f"this run {len(ours)}")
  return found
