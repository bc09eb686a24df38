"""Workers of a multi_worker_mirrored run agree (`tfmgpu.training.workers`):
a decision one worker takes alone is every worker's, end to end on a local
2-worker cluster running `workers_task.py`."""

import os
import sys

import pytest

from tests.cluster import helpers

pytestmark = pytest.mark.slow

TASK = os.path.join(os.path.dirname(__file__), "workers_task.py")


def run_task(mode: str) -> tuple[int, str]:
  run = helpers.ClusterRun([sys.executable, TASK, mode], num_workers=2,
                           timeout_s=120)
  result = run.join()
  return result.exit_code, run.text


def test_stop_training_on_one_worker_stops_every_worker_after_that_step():
  """A callback on the chief alone set stop_training after batch 4: the
  chief stopped, and worker 1 crashed in its next collective."""
  code, text = run_task("stop")
  assert code == 0, text[-5000:]
  for task in ("worker:0", "worker:1"):
    assert "DONE: steps 4 epochs 1" in helpers.task_lines(text, task), (
        text[-5000:])


def test_workers_given_other_settings_all_refuse_naming_them():
  """Worker 1's fit got global_batch_size=32 and seed=1: both workers
  trained to exit 0, silently, weights that neither call asks for."""
  code, text = run_task("mismatch")
  assert code != 0, text[-5000:]
  for task in ("worker:0", "worker:1"):
    lines = helpers.task_lines(text, task)
    assert "DONE" not in lines, text[-5000:]
    assert ("REFUSED: The workers of this multi_worker_mirrored run were "
            "given different settings: global_batch_size (worker 0: 64, "
            "worker 1: 32); seed (worker 0: 0, worker 1: 1). ") in lines, (
                text[-5000:])
