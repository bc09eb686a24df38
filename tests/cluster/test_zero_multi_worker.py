"""Multi-worker ZeRO's collectives on a 2-worker local cluster (issue 28).

`all_gather_owned` gives each worker the owners' values; a stage-1 Adam
step (`apply_owned`, slots on their owner only) equals the unsharded step
bit for bit, its slots gathered (`gather_slots`) equal the unsharded
ones and scatter back (`scatter_slots`); TF 2.21 has no ring
reduce-scatter on CPU (the fact `zero_collectives` is built around: if
this test starts failing because the op works, the step can use it).
"""

import ast
import os
import re
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
    assert "scattered equal True" in lines, lines
    plain, zero = re.search(r"^digests (\w+) (\w+)$", lines, re.M).groups()
    assert zero == plain, lines
    slots, mine = re.search(r"^zero slots (.*) owned (.*)$", lines,
                            re.M).groups()
    # Adam's two slots for each owned variable, none for the others.
    assert ast.literal_eval(slots) == [s for s in ast.literal_eval(mine)
                                       for _ in range(2)], lines
  digests = {helpers.task_lines(run.text, t).split("digests ")[1][:64]
             for t in ("worker:0", "worker:1")}
  assert len(digests) == 1, digests
