"""A callback that stands for a kill at a given step, for resume tests."""

import keras


class Killed(BaseException):
  """Stands for SIGKILL: nothing after it runs, not even `except Exception`."""


class KillAt(keras.callbacks.Callback):
  """Raises `Killed` after global step `step` (1-based) of this fit."""

  def __init__(self, step):
    super().__init__()
    self.step, self.done = step, 0

  def on_train_batch_end(self, batch, logs=None):
    self.done += 1
    if self.done == self.step:
      raise Killed(self.step)
