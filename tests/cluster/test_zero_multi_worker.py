"""Multi-worker ZeRO's collectives on a 2-worker local cluster (issue 28).

`all_gather_owned` gives each worker the owners' values; TF 2.21 has no
ring reduce-scatter on CPU (the fact `zero_collectives` is built around:
if this test starts failing because the op works, the step can use it).
"""

import os
import sys

import pytest

from tests.cluster import helpers

pytestmark = pytest.mark.slow
TASK = os.path.join(os.path.dirname(__file__), "zero_gather_task.py")


def test_all_gather_owned_across_two_workers(tmp_path):
  run = helpers.ClusterRun([sys.executable, TASK], num_workers=2,
                           tmpdir=str(tmp_path))
  result = run.join()
  assert result.exit_code == 0, run.text[-4000:]
  for task in ("worker:0", "worker:1"):
    lines = helpers.task_lines(run.text, task)
    assert "gathered [[10.0], [1.0], [12.0], [3.0]]" in lines, lines
    assert "reduce_scatter unavailable" in lines, lines
