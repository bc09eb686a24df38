"""multi_worker_mirrored through `python -m tfmgpu.train` on a 2-worker cluster.

Parity: 2 workers x 1 replica must train the model that one process with 2
replicas trains on the same global batches (`training.inputs.array_dataset_fn` shards each
epoch's order so that one step's per-replica batches make up the same global
batch), and only the chief keeps outputs. With `--zero_stage=3` (in-graph:
the chief drives worker 1's CPU, where worker 1's shards live) the run
equals the unsharded ones and survives a preemption of the serving worker.

Preemption: SIGTERM to one worker, every worker saves at the same step and
the job exits 42; the same command resumes from that step and ends with the
weights of the uninterrupted run (the shared `uninterrupted_mwms` run, same
arguments: the tests that read it share a module, so one pytest-xdist
worker makes it).
"""

import os
import re
import shutil
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.cluster import helpers
from tfmgpu import runs
from tfmgpu.training import checkpoints

pytestmark = pytest.mark.slow


MWMS = ("--strategy=multi_worker_mirrored", "--virtual_devices=2")
ZERO3 = ("--strategy=multi_worker_mirrored", "--zero_stage=3",
         "--virtual_devices=2")
TASK_CPUS = ("2 on /job:worker/replica:0/task:0/device:CPU:0, "
             "/job:worker/replica:0/task:1/device:CPU:0")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The run of MWMS_ARGS in one process, mirrored over 2 replicas."""
  return runs.run_training(
      helpers.reference_config(tmp_path_factory.mktemp("one") / "ref"))


def max_diff(a: keras.Model, b: keras.Model) -> float:
  return max(float(np.abs(x - y).max())
             for x, y in zip(a.get_weights(), b.get_weights()))


def test_two_workers_train_what_one_process_trains(uninterrupted_mwms,
                                                   one_process):
  run = uninterrupted_mwms
  assert run["result"].exit_code == 0, run["text"][-5000:]
  text = run["text"]
  # Each worker (2 logical CPUs, --virtual_devices=2) holds one replica.
  for task in ("worker:0", "worker:1"):
    assert helpers.summary_value(text, task, "replicas").startswith(
        f"2 on /job:worker/replica:0/task:{task[-1]}/device:CPU:0")
  # Both workers end with bit-identical weights.
  digests = {t: helpers.summary_value(text, t, "weights sha256")
             for t in ("worker:0", "worker:1")}
  assert len(set(digests.values())) == 1, digests

  # Only the chief (worker 0) keeps outputs; worker 1's temp files are gone.
  # The chief's run record stays; its lock (run.lock) is released (#16).
  model_dir = run["model_dir"]
  assert sorted(os.listdir(model_dir)) == ["checkpoints", "model.keras",
                                           "run.json", "summaries"]
  assert sorted(f for f in os.listdir(model_dir / "checkpoints")
                if f.endswith(".index")) == [
                    "ckpt-1.index", "ckpt-2.index", "ckpt-3.index"]
  assert helpers.summary_value(text, "worker:1", "saved model") == "none"
  assert os.listdir(run["tmpdir"]) == []

  # Parity with one process and 2 replicas. The two add per-example
  # gradients in different orders (3e-7 apart after one step); Adam
  # amplifies that over 90 steps to 3e-4 (Keras's Adam and the fused one
  # alike), on dithered digits (`helpers.DITHERED_DIGITS`; on the plain
  # digits' tied max-pools Keras's Adam drifts 6e-2).
  reference = one_process
  chief = keras.models.load_model(model_dir / "model.keras")
  for a, b in zip(chief.get_weights(), reference.model.get_weights()):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
  assert float(helpers.summary_value(text, "worker:0", "test loss / accuracy"
                                      ).split(" / ")[1]) == pytest.approx(
                                          reference.test_accuracy, abs=2e-3)
  print(f"2-worker run {run['seconds']:.1f} s; test accuracy "
        f"{reference.test_accuracy:.4f} (one process)")


def test_zero3_over_two_workers_resumes_to_the_unsharded_weights(
    uninterrupted_mwms, one_process, tmp_path):
  """SIGTERM to the serving worker: the chief saves (worker 1's shards are
  still alive), both exit 42, and the same command resumes and ends with
  the weights one process trains."""
  tmpdir = str(tmp_path / "worker_tmp")
  model_dir = tmp_path / "run"
  args = [*ZERO3, f"--model_dir={model_dir}", *helpers.MWMS_ARGS]
  run = helpers.ClusterRun(helpers.train_command(*args), num_workers=2,
                           tmpdir=tmpdir)
  run.wait_for(r"\[worker:0\] .*Training data")
  run.signal_task("worker:1", signal.SIGTERM)
  assert run.join().exit_code == 42, run.text[-5000:]
  said = (r"error: Preempted: SIGTERM reached task worker:1\. Saved (\S+) "
          r"at global step (\d+)")
  saved = re.search(rf"\[worker:0\] {said}", run.text)
  assert saved, run.text[-5000:]
  assert re.search(rf"\[worker:1\] from the chief \(worker:0\): {said}",
                   run.text), run.text[-5000:]
  path, step = saved.group(1), int(saved.group(2))
  assert 0 < step < 90, step
  resumed, text = helpers.run_cluster(args, num_workers=2, tmpdir=tmpdir)
  assert resumed.exit_code == 0, text[-5000:]
  assert re.search(rf"\[worker:0\] .*Resumed from {re.escape(path)}: .*"
                   rf"global step {step}\.", text), text[-5000:]
  assert helpers.summary_value(text, "worker:0", "replicas") == TASK_CPUS
  assert "The chief's run finished" in helpers.task_lines(text, "worker:1")
  zero = keras.models.load_model(model_dir / "model.keras")
  # One process's mirrored x2 adds the same two per-replica gradients:
  # equal (measured 0.0, uninterrupted and resumed). The 2-worker unsharded
  # run sums in another order, which Adam amplifies over 90 steps as for
  # one process (test above).
  assert max_diff(zero, one_process.model) <= 1e-6
  unsharded = keras.models.load_model(uninterrupted_mwms["model_dir"] /
                                      "model.keras")
  assert max_diff(zero, unsharded) <= 1e-3


@pytest.mark.parametrize("optimizer, tol", [("sgd", 1e-5)])
def test_zero3_over_two_workers_equals_the_unsharded_one_process_run(
    optimizer, tol, tmp_path):
  """10 SGD steps: a gradient off by a scale shows at once (Adam hides
  it). The reference is one process mirrored over 2 replicas, which adds
  the same two per-replica gradients (the 90-step Adam run above equals it
  to 1e-6; the unsharded 2-worker run equals one process in the first
  test). Adam's sharded slots: the 90-step run above (to one process,
  1e-6) and `test_zero_in_graph.py` (to unsplit, 1e-4)."""
  short = dict(epochs=1, steps_per_epoch=10, optimizer=optimizer,
               learning_rate=0.01)
  model_dir = tmp_path / "stage3"
  result, text = helpers.run_cluster(
      [*ZERO3, f"--dataset={helpers.DITHERED_DIGITS}", "--global_batch_size=64",
       "--seed=0", "--verbose=0", f"--model_dir={model_dir}",
       *(f"--{k}={v}" for k, v in short.items())],
      num_workers=2, tmpdir=str(tmp_path / "worker_tmp"))
  assert result.exit_code == 0, text[-5000:]
  assert helpers.summary_value(text, "worker:0", "replicas") == TASK_CPUS
  zero = keras.models.load_model(model_dir / "model.keras")
  unsharded = runs.run_training(helpers.reference_config(
      tmp_path / "one_process", **short)).model
  diff = max_diff(zero, unsharded)
  print(f"{optimizer}: zero 3 over 2 workers vs one process, 10 steps: "
        f"{diff:.3g}")
  assert diff <= tol


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
  chief = keras.models.load_model(model_dir / "model.keras")
  for a, b in zip(other.model.get_weights(), chief.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
