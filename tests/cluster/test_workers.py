"""Workers of a multi_worker_mirrored run agree (`tfmgpu.training.workers`):
a decision one worker takes alone is every worker's, end to end on a local
2-worker cluster. One launch of `workers_task.py` runs three fits in turn
(each test reads its own): worker 1 given other settings, a stop on the
chief alone, and a Python run with a `model_dir` that exits without
`Trainer.close()`.
"""

import os
import sys

import pytest

from tests.cluster import helpers

pytestmark = pytest.mark.slow

TASK = os.path.join(os.path.dirname(__file__), "workers_task.py")


@pytest.fixture(scope="module")
def workers_run(tmp_path_factory):
  """The one launch of `workers_task.py`: its exit code, output and dirs."""
  root = tmp_path_factory.mktemp("workers")
  tmpdir = root / "worker_tmp"
  run = helpers.ClusterRun([sys.executable, TASK, str(root / "run")],
                           num_workers=2, timeout_s=120, tmpdir=str(tmpdir))
  result = run.join()
  assert result.exit_code == 0, run.text[-5000:]
  return {"text": run.text, "model_dir": root / "run", "tmpdir": tmpdir}


def test_workers_given_other_settings_all_refuse_naming_them(workers_run):
  """Worker 1's fit got global_batch_size=32 and seed=1: both workers
  trained to exit 0, silently, weights that neither call asks for."""
  text = workers_run["text"]
  for task in ("worker:0", "worker:1"):
    lines = helpers.task_lines(text, task)
    assert "mismatch DONE" not in lines, text[-5000:]
    assert ("mismatch REFUSED: The workers of this multi_worker_mirrored "
            "run were given different settings: global_batch_size (worker "
            "0: 64, worker 1: 32); seed (worker 0: 0, worker 1: 1). "
            ) in lines, text[-5000:]


def test_stop_training_on_one_worker_stops_every_worker_after_that_step(
    workers_run):
  """A callback on the chief alone set stop_training after batch 4: the
  chief stopped, and worker 1 crashed in its next collective."""
  text = workers_run["text"]
  for task in ("worker:0", "worker:1"):
    assert "stop DONE: steps 4 epochs 1" in helpers.task_lines(text, task), (
        text[-5000:])


def test_a_python_run_leaves_no_temporary_files_without_close(workers_run):
  # The trial's leak (#3): worker 1's checkpoint copies stayed in
  # /tmp/tfmgpu-ckpt-* unless the script called Trainer.close().
  text = workers_run["text"]
  for task in ("worker:0", "worker:1"):
    assert "saved DONE: steps 4 epochs 2" in helpers.task_lines(text, task), (
        text[-5000:])
  checkpoints = workers_run["model_dir"] / "checkpoints"
  assert sorted(f for f in os.listdir(checkpoints)
                if f.endswith(".index")) == ["ckpt-1.index", "ckpt-2.index"]
  assert os.listdir(workers_run["tmpdir"]) == []
