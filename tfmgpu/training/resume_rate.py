"""The learning rate a resumed run trains with.

An epoch's checkpoint is written before the callbacks' `on_epoch_end`
(what they change for a moment, such as `SwapEMAWeights` swapping the
moving averages in until the next epoch begins, must not be saved). A
rate they change for good (`ReduceLROnPlateau` lowering it) is recorded
beside the checkpoints, in `learning_rates.json`, once they have run
(`record`); each checkpoint also holds the rate its run was given.

On resume (`resumed_rate`) the run trains with the rate the stopped run
would have gone on with (the recorded one, else the checkpoint's), unless
it was given another rate than both the stopped run was given and that
one: a new `--learning_rate` wins, as the NaN error's advice expects.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from absl import logging

from tfmgpu import _compat
from tfmgpu import files

RATES_NAME = "learning_rates.json"


def rate_variable(optimizer: Any) -> Any:
  """The variable holding `optimizer`'s learning rate (`None`: a schedule)."""
  while getattr(optimizer, "inner_optimizer", None) is not None:
    optimizer = optimizer.inner_optimizer  # LossScaleOptimizer's own is unused.
  return _compat.learning_rate_variable(optimizer)


def _read(directory: str) -> dict[str, float]:
  try:
    with open(os.path.join(directory, RATES_NAME), encoding="utf-8") as f:
      rates = json.load(f)
  except (OSError, ValueError):
    return {}
  return rates if isinstance(rates, dict) else {}


def record(directory: str, checkpoint: str, rate: float) -> None:
  """Records that the run goes on from `checkpoint` at `rate` (set by a
  callback after it was written); entries of deleted checkpoints go."""
  rates = {name: value for name, value in _read(directory).items()
           if os.path.exists(os.path.join(directory, f"{name}.index"))}
  rates[os.path.basename(checkpoint)] = rate
  text = json.dumps(rates, indent=1, sort_keys=True).encode("utf-8")
  files.write_atomically(os.path.join(directory, RATES_NAME),
                         lambda f: f.write(text))


def resumed_rate(optimizer: Any, given: float | None, saved_given: float,
                 checkpoint: str, directory: str) -> float | None:
  """Sets the learning rate after `checkpoint` was restored; returns the
  rate to record as given to this run (`None`: a schedule).

  Args:
    optimizer: the restored optimizer (holding the checkpoint's rate).
    given: the rate it held before the restore (this run's).
    saved_given: the rate the stopped run was given (NaN: not recorded).
    checkpoint: the path restored.
    directory: where the checkpoints and `learning_rates.json` are.
  """
  variable = rate_variable(optimizer)
  if variable is None or given is None:
    return given
  held = float(variable.numpy())
  went_on = _read(directory).get(os.path.basename(checkpoint), held)
  if given == went_on or (not math.isnan(saved_given) and given == saved_given):
    variable.assign(went_on)
    if went_on != given:
      logging.info("learning_rate: %.6g, as the run that saved %s went on "
                   "(it was given %.6g, as this run).", went_on, checkpoint,
                   given)
    return saved_given if not math.isnan(saved_given) else given
  variable.assign(given)
  if went_on != given:
    logging.info("learning_rate: %s holds %.6g; training with the %.6g given "
                 "to this run.", checkpoint, went_on, given)
  return given
