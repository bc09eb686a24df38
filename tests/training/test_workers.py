"""`workers.require_same_run` and `require_same_start` on a stand-in for
the all-gather (the real one, two workers: tests/cluster/test_workers.py)."""

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


class _TwoWorkerVotes(workers.AnyWorker):
  """`AnyWorker` as in a 2-worker run: the all-reduce adds the other
  worker's flags (`other(votes so far, flags)`) to this one's, and logs how
  many flags each all-reduce carried (shared by every instance)."""

  def __init__(self, strategy, other, log):
    super().__init__(strategy)
    self.collective, self._agree = True, self._sum
    self._other, self._log = other, log

  def _sum(self, flags):
    mine = np.asarray(flags, float)
    self._log.append(mine.size)
    theirs = np.asarray(self._other(len(self._log), mine.size), float)
    return mine + theirs.reshape(mine.shape)


def _calm(vote, n):
  del vote
  return [0] * n


def _sigterm_from_vote_2(vote, n):  # (SIGTERM, stop_training) after a step.
  return [int(vote >= 2 and n == 2)] + [0] * (n - 1)


def _stops_at_vote_2(vote, n):  # stop_training: always the last flag.
  return [0] * (n - 1) + [int(vote >= 2)]


@pytest.mark.parametrize("other", [_calm, _sigterm_from_vote_2,
                                   _stops_at_vote_2])
def test_one_all_reduce_per_call_carries_stop_training_and_sigterm(
    other, tmp_path, monkeypatch):
  """A multi-worker run all-reduced a callback's `stop_training` and then,
  in a second all-reduce, SIGTERM after every call (two collectives per
  step); one now carries both, and either flag of the other worker still
  stops this one after the same step."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfmgpu.training import checkpoints  # pylint: disable=import-outside-toplevel
  from tfmgpu.training.loop import Trainer  # pylint: disable=import-outside-toplevel
  log = []
  monkeypatch.setattr(workers, "AnyWorker",
                      lambda s: _TwoWorkerVotes(s, other, log))
  monkeypatch.setattr(workers, "require_same_run", lambda *args: None)
  monkeypatch.setattr(workers, "require_same_start", lambda *args: None)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  trainer = Trainer(model, strategy=tf.distribute.get_strategy(), verbose=0,
                    steps_per_execution=1, model_dir=str(tmp_path))
  x = np.ones((24, 4), np.float32)
  fit = lambda: trainer.fit(x, np.zeros(24, np.int32), epochs=1,
                            global_batch_size=8, steps_per_epoch=3)
  if other is _sigterm_from_vote_2:
    with pytest.raises(checkpoints.PreemptedError, match=(
        "SIGTERM reached another worker. Saved .* at global step 2")):
      fit()
    assert log == [2, 2]
  elif other is _stops_at_vote_2:
    assert fit().steps == 2 and model.stop_training
    assert log == [2, 2, 2]  # Step 1, step 2 (stop), the epoch's end.
  else:
    assert fit().steps == 3
    assert log == [2, 2, 1, 2]  # The last step asks stop_training alone.


class _OtherStart(workers.AnyWorker):
  """`AnyWorker` as in a 2-worker run whose worker 1 restored nothing (its
  own empty model_dir): its settings agree, its start is a fresh one."""

  def __init__(self, strategy):
    super().__init__(strategy)
    self.collective = True

  def rows(self, values):
    fresh = np.array([-1, 0, 0, 0], np.int64)
    return np.stack([values, fresh if len(values) == 4 else values])


def test_a_worker_that_restored_another_checkpoint_stops_every_worker(
    tmp_path, monkeypatch):
  """The chief resumed at epoch 2 from ckpt-1 while worker 1, on its own
  empty model_dir, started afresh: both trained in lock-step, silently,
  mixed weights. Now every worker refuses after the restore, before any
  step, naming each start and the shared model_dir it needs."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfmgpu.training.loop import Trainer  # pylint: disable=import-outside-toplevel
  x, y = np.ones((16, 4), np.float32), np.zeros(16, np.int32)

  def trainer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    return Trainer(model, strategy=tf.distribute.get_strategy(), verbose=0,
                   model_dir=str(tmp_path))
  trainer().fit(x, y, epochs=1, global_batch_size=8)  # ckpt-1: 2 steps.
  monkeypatch.setattr(workers, "AnyWorker", _OtherStart)
  resumed = trainer()
  with pytest.raises(workers.WorkersDisagreeError, match=(
      r"resumed from different checkpoints: worker 0: ckpt-1 \(after 1 "
      r"whole epoch, global step 2\); worker 1: no checkpoint \(a fresh "
      r"start\)\. .* Every worker must see the chief's --model_dir: .*"
      r"this worker read .*checkpoints\)")):
    resumed.fit(x, y, epochs=2, global_batch_size=8)
  assert int(resumed.optimizer.iterations.numpy()) == 2  # No step run.
  assert not (tmp_path / "checkpoints" / "ckpt-2.index").exists()
