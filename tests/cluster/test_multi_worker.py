"""multi_worker_mirrored through `python -m tfmgpu.train` on a 2-worker cluster.

Parity: 2 workers x 1 replica must train the model that one process with 2
replicas trains on the same global batches (`training.inputs.array_dataset_fn` shards each
epoch's order so that one step's per-replica batches make up the same global
batch), and only the chief keeps outputs.
"""

import os

import keras
import numpy as np
import pytest

from tests.cluster import helpers
from tfmgpu import runs

pytestmark = pytest.mark.slow


def test_two_workers_train_what_one_process_trains(uninterrupted_mwms,
                                                   tmp_path):
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
  reference = runs.run_training(
      helpers.reference_config(tmp_path / "ref"))
  chief = keras.models.load_model(model_dir / "model.keras")
  for a, b in zip(chief.get_weights(), reference.model.get_weights()):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
  assert float(helpers.summary_value(text, "worker:0", "test loss / accuracy"
                                      ).split(" / ")[1]) == pytest.approx(
                                          reference.test_accuracy, abs=2e-3)
  print(f"2-worker run {run['seconds']:.1f} s; test accuracy "
        f"{reference.test_accuracy:.4f} (one process)")
