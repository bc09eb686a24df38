"""Runs `test_3d.py` (data x pipeline x tensor, 2 x 2 x 2) in a process
of its own with 8 logical CPUs; the suite's processes have 4.

A file of its own: it is the suite's longest test, and pytest-xdist's
`--dist loadfile` gives a file to one worker, so beside the other hybrid
tests it made the longest unit of work, which the other worker waited for.
"""

import os
import re
import subprocess
import sys


def test_2x2x2_on_eight_devices():
  """Every test of `test_3d.py` must pass there (none skipped)."""
  here = os.path.dirname(__file__)
  env = dict(os.environ, TFMGPU_TEST_DEVICES="8")
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       os.path.join(here, "test_3d.py")], env=env, capture_output=True,
      text=True, timeout=900, check=False)
  tail = run.stdout[-3000:] + run.stderr[-2000:]
  assert run.returncode == 0, tail
  assert re.search(r"\b3 passed\b", run.stdout), tail
  assert "skipped" not in run.stdout, tail
