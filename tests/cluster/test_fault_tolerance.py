"""Worker death on a 2-worker multi_worker_mirrored cluster.

A worker killed without notice: the launcher stops the rest, names the dead
worker, and the last checkpoint still loads. (SIGTERM to a worker, saved
and resumed to the uninterrupted run's weights: `test_multi_worker.py`,
beside the other tests of that shared run. A parameter-server job that
loses a worker and goes on: the resumed run of `test_parameter_server.py`.)
"""

import os
import signal

import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import models
from tfmgpu.training import checkpoints
from tests.cluster import helpers

pytestmark = pytest.mark.slow

MWMS = ("--strategy=multi_worker_mirrored", "--virtual_devices=2")


def test_sigkill_of_a_worker_stops_the_job_and_keeps_the_last_checkpoint(
    tmp_path):
  model_dir = tmp_path / "run"
  run = helpers.ClusterRun(helpers.train_command(
      *MWMS, f"--model_dir={model_dir}", *helpers.MWMS_ARGS), num_workers=2,
                           grace_s=3, tmpdir=str(tmp_path / "worker_tmp"))
  run.wait_for(r"\[worker:0\] .*epoch 1/3")
  run.signal_task("worker:1", signal.SIGKILL)
  result = run.join()

  assert result.exit_code == 128 + signal.SIGKILL
  assert result.first_failure == "worker:1"
  assert ("[launcher] Task worker:1 was killed by signal SIGKILL (9). "
          "Stopping the other tasks: worker:0.") in run.text
  # worker:0 did not finish (or time out): the launcher stopped it.
  assert result.stopped == ("worker:0",)
  # The last good checkpoint loads into a fresh model and optimizer.
  strategy = tfmgpu.get_strategy("one_device")
  with strategy.scope():
    model = models.build_model("convnet", input_shape=(28, 28, 1),
                               num_classes=10, seed=1)
  trainer_ckpt = checkpoints.Checkpointer(
      str(model_dir), strategy, model=model,
      optimizer=tf.keras.optimizers.Adam())
  assert trainer_ckpt.latest
  assert trainer_ckpt.restore_latest() >= 1
  assert trainer_ckpt.progress.step >= 30
  assert os.path.basename(trainer_ckpt.latest).startswith("ckpt-")
