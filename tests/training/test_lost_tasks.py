"""A task of the cluster lost while training (`training.lost_tasks`), and
the SIGTERM its survivors then get from the launcher (`training.preemption`
reading `tfmgpu.stop_notes`). The real clusters: tests/cluster."""

import logging
import os
import signal
import types

import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import data
from tfmgpu import runs
from tfmgpu import stop_notes
from tfmgpu.config import TrainConfig
from tfmgpu.training import checkpoints
from tfmgpu.training import lost_tasks
from tfmgpu.training import preemption

# What TF 2.21 raised in the trial: a multi_worker_mirrored survivor whose
# peer died, and a parameter-server coordinator whose ps task was killed.
PEER_DIED = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined "
    "at (most recent call last):\n...\nCollective ops is aborted by: Error "
    "reported from /job:worker/task:1: The following tasks are unhealthy "
    "(stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks "
    "have crashed. Check the task logs for an earlier error, or scheduler "
    "events (e.g. preemption, eviction) to debug further.\n")
PS_DIED = (
    "Graph execution error:\n\n2 root error(s) found.\n  (0) UNAVAILABLE:  "
    "failed to connect to all addresses; last error: UNKNOWN: "
    "ipv4:127.0.0.1:50725: Failed to connect to remote host: Connection "
    "refused\nAdditional GRPC error information from remote target "
    "/job:ps/replica:0/task:0/device:CPU:0 while calling "
    "/tensorflow.eager.EagerService/RunComponentFunction:\n:UNKNOWN:Error "
    "received from peer\n  (1) CANCELLED:  Function was cancelled before it "
    "was started\n0 successful operations.\n0 derived errors ignored.\n"
    "Additional GRPC error information from remote target "
    "/job:worker/replica:0/task:1 while calling "
    "/tensorflow.eager.EagerService/Enqueue:\n:UNKNOWN:Error received\n")


def test_the_task_tf_names_is_the_lost_one():
  assert lost_tasks.lost_tasks(PEER_DIED) == ["worker:1"]
  # The worker named there only passed the parameter server's error on.
  assert lost_tasks.lost_tasks(PS_DIED) == ["ps:0"]
  assert lost_tasks.lost_tasks("Socket closed") == []


def _note(tmp_path, monkeypatch, reason):
  path = str(tmp_path / "note")
  stop_notes.write(path, reason)
  monkeypatch.setenv(stop_notes.NOTE_ENV, path)


@pytest.mark.parametrize("message,note,said", [
    (PEER_DIED, "worker:1 exited with code 1",
     "worker:1 stopped responding (the launcher: worker:1 exited with code "
     "1), and training"),
    (PS_DIED, None, "ps:0 stopped responding, and training"),
    ("Socket closed", None, "A peer worker or parameter server stopped "
     "responding, and training")], ids=["peer", "ps", "unnamed"])
def test_a_lost_task_ends_the_run_in_one_error_naming_it_and_the_checkpoint(
    tmp_path, monkeypatch, message, note, said):
  """The survivor printed TF's ~50-line UnavailableError (a raw gRPC
  traceback under parameter servers); `run_training` now raises one
  `LostTaskError` (the CLI's `error:` line) naming the task, the last
  checkpoint kept and the command that resumes."""
  if note:
    _note(tmp_path, monkeypatch, note)
  kept = checkpoints.Checkpointer(
      str(tmp_path), tf.distribute.get_strategy(), model=_model(),
      optimizer=_optimizer())
  path = kept.save(1, step=4, epoch_step=4)

  def fit(*args, **kwargs):
    raise tf.errors.UnavailableError(None, None, message)
  trainer = types.SimpleNamespace(fit=fit, checkpointer=kept)
  rows = np.zeros((8, 2), np.float32), np.zeros(8, np.int32)
  arrays = data.Arrays("tiny", *rows, *rows, num_classes=2)
  config = TrainConfig(strategy="multi_worker_mirrored")
  with pytest.raises(lost_tasks.LostTaskError) as raised:
    runs._fit_and_test(trainer, config, arrays)  # pylint: disable=protected-access
  assert str(raised.value) == (
      f"{said} cannot go on without it. The last checkpoint kept is {path} "
      "(epoch 2, step 4 of it, global step 4): run the same command again "
      "to resume from it.")
  # One process alone has no peer to lose: TF's error as it is.
  with pytest.raises(tf.errors.UnavailableError):
    runs._fit_and_test(trainer, config.replace(strategy="one_device"),  # pylint: disable=protected-access
                       arrays)


def _model():
  import keras  # pylint: disable=import-outside-toplevel
  return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


def _optimizer():
  import keras  # pylint: disable=import-outside-toplevel
  return keras.optimizers.SGD()


@pytest.fixture
def sigterm_restored():
  previous = signal.getsignal(signal.SIGTERM)
  yield
  preemption.hold_sigterm_after_preemption(False)
  signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_from_the_launcher_says_why(tmp_path, monkeypatch, caplog,
                                              sigterm_restored):
  """The survivor logged "SIGTERM received: saving a checkpoint ..." (a
  preemption notice, it said) when the launcher was stopping it because
  its peer had died."""
  del sigterm_restored
  _note(tmp_path, monkeypatch, "worker:1 exited with code 1")
  with caplog.at_level(logging.WARNING):
    with preemption.PreemptionWatcher(tf.distribute.get_strategy()) as w:
      os.kill(os.getpid(), signal.SIGTERM)
      assert w.received
  assert ("SIGTERM from the launcher, which stops every task because "
          "worker:1 exited with code 1: saving a checkpoint at the next step "
          "boundary if the tasks still answer, then stopping.") in caplog.text
  assert "SIGTERM received" not in caplog.text


def test_a_sigterm_after_a_lost_peer_waits_for_the_error_line(
    caplog, sigterm_restored):
  """Under parameter servers the coordinator, past `fit` with TF's error,
  was killed by the launcher's SIGTERM before it said anything. The CLI's
  hold now covers a lost peer as it covers a preemption save."""
  del sigterm_restored
  preemption.hold_sigterm_after_preemption()
  previous = signal.getsignal(signal.SIGTERM)
  with pytest.raises(tf.errors.UnavailableError):
    with preemption.PreemptionWatcher(tf.distribute.get_strategy()):
      raise tf.errors.UnavailableError(None, None, PS_DIED)
  assert signal.getsignal(signal.SIGTERM) is not previous  # Else: killed.
  with caplog.at_level(logging.WARNING):
    os.kill(os.getpid(), signal.SIGTERM)
  assert ("SIGTERM again after a peer task was lost: ignored while this "
          "process says so and exits.") in caplog.text
