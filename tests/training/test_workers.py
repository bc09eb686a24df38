"""`workers.require_same_run` on a stand-in for the all-gather (the real
one, two workers: tests/cluster/test_workers.py)."""

import numpy as np
import pytest

from tfmgpu.training import workers


class _TwoWorkers:
  """Worker 1's row is worker 0's with `changes` applied."""
  collective = True

  def __init__(self, other):
    self.other = other

  def rows(self, values):
    theirs = np.array([workers._encode(v) for v in self.other.values()],  # pylint: disable=protected-access
                      np.int64).reshape(-1)
    return np.stack([values, theirs])


def test_numpy_floats_and_uncounted_steps_are_named():
  mine = {"learning_rate": np.float32(0.1), "steps_per_epoch": 8}
  theirs = {"learning_rate": np.float32(0.2), "steps_per_epoch": 9}
  with pytest.raises(workers.WorkersDisagreeError, match=(
      r"learning_rate \(worker 0: 0\.1, worker 1: 0\.2\); steps_per_epoch "
      r"\(worker 0: 8, worker 1: 9\); \(without steps_per_epoch= each "
      r"worker counts the batches of its own input")):
    workers.require_same_run(_TwoWorkers(theirs), mine)
  workers.require_same_run(_TwoWorkers(dict(mine)), mine)  # Agreeing: fine.
