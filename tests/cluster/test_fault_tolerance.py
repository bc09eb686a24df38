"""Preemption and worker death on a 2-worker multi_worker_mirrored cluster.

SIGTERM to one worker: every worker saves at the same step and the job exits
42; the same command resumes from that step and ends with the weights of the
uninterrupted run (the shared `uninterrupted_mwms` run, same arguments). A
worker killed without notice: the launcher stops the rest, names the dead
worker, and the last checkpoint still loads.
"""

import os
import re
import shutil
import signal

import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import runs
from tfmgpu import models
from tfmgpu.training import checkpoints
from tests.cluster import helpers

pytestmark = pytest.mark.slow

MWMS = ("--strategy=multi_worker_mirrored", "--virtual_devices=2")


def test_sigterm_to_a_worker_saves_exits_42_and_resumes(uninterrupted_mwms,
                                                        tmp_path):
  model_dir = tmp_path / "run"
  args = [*MWMS, f"--model_dir={model_dir}", *helpers.MWMS_ARGS]
  tmpdir = str(tmp_path / "worker_tmp")  # Keeps /tmp clean.
  run = helpers.ClusterRun(helpers.train_command(*args), num_workers=2,
                           tmpdir=tmpdir)
  run.wait_for(r"\[worker:1\] .*epoch 1/3")
  run.signal_task("worker:1", signal.SIGTERM)
  result = run.join()

  assert result.exit_code == checkpoints.EXIT_PREEMPTED, run.text[-5000:]
  saved = re.search(r"\[worker:1\] error: Preempted: SIGTERM reached this "
                    r"process\. Saved (\S+) at global step (\d+)", run.text)
  assert saved, run.text[-5000:]
  assert re.search(r"\[worker:0\] error: Preempted: SIGTERM reached another "
                   r"worker\. Saved \S+ at global step " + saved.group(2),
                   run.text)
  step = int(saved.group(2))
  assert step > 30  # After epoch 1's checkpoint: a step-level save.
  path = saved.group(1)
  assert path.startswith(str(model_dir / "checkpoints" / "ckpt-"))
  assert tf.train.load_variable(path, "step/.ATTRIBUTES/VARIABLE_VALUE") == step
  preempted_copy = tmp_path / "preempted_copy"
  shutil.copytree(model_dir, preempted_copy)

  # The same command resumes at the saved step, not from zero ...
  resumed, text = helpers.run_cluster(args, num_workers=2, tmpdir=tmpdir)
  assert resumed.exit_code == 0, text[-5000:]
  for task in ("worker:0", "worker:1"):
    assert re.search(rf"\[{task}\] .*Resumed from {re.escape(path)}: epoch "
                     rf"\d, step \d+ of it, global step {step}\.", text), text
  # ... and ends with the uninterrupted run's weights, bit for bit.
  digest = helpers.summary_value(text, "worker:0", "weights sha256")
  assert uninterrupted_mwms["result"].exit_code == 0
  assert digest == helpers.summary_value(uninterrupted_mwms["text"],
                                         "worker:0", "weights sha256")
  assert helpers.summary_value(text, "worker:1", "weights sha256") == digest

  # A different topology resumes the same checkpoint: one process, 4 replicas.
  other = runs.run_training(helpers.reference_config(
      preempted_copy, num_replicas=4))
  assert other.result.initial_step == step
  chief = tf.keras.models.load_model(model_dir / "model.keras")
  for a, b in zip(other.model.get_weights(), chief.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


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


def test_a_parameter_server_job_goes_on_without_a_lost_worker(tmp_path):
  # Issue 16 item 6: the launcher used to stop the whole job (and SIGKILL the
  # coordinator) when one worker died; the coordinator reschedules instead.
  model_dir = tmp_path / "run"
  run = helpers.ClusterRun(helpers.train_command(
      "--strategy=parameter_server", "--model=mlp", "--epochs=3",
      "--steps_per_epoch=40", "--steps_per_execution=1", "--verbose=0",
      f"--model_dir={model_dir}"), num_workers=2, num_ps=1, chief=True)
  run.wait_for(r"\[chief:0\] .*epoch 1/3")
  run.signal_task("worker:1", signal.SIGKILL)
  result = run.join()

  assert result.exit_code == 0, run.text[-5000:]
  assert result.lost == ("worker:1",)
  assert ("[launcher] Task worker:1 was killed by signal SIGKILL (9). "
          "Parameter-server training goes on without it") in run.text
  latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
  assert tf.train.load_variable(latest,
                                "epoch/.ATTRIBUTES/VARIABLE_VALUE") == 3
  assert (model_dir / "model.keras").exists()
