"""Measurements taken in a fresh Python process.

The bench splits the CPU into logical devices and gives each op one thread
(`devices.configure_virtual_devices`); a single-device run as a user makes
it gets every core per op. TensorFlow fixes its threads when it starts, so
single-device figures (the compute ceiling, the language model on one
device) are measured in a child process that keeps TensorFlow's defaults,
while the bench's own process waits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_MARK = "TFMGPU_CHILD_JSON "

_CHILD = f"""
import importlib, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)(
    **json.loads(sys.argv[2]))
print({_MARK!r} + json.dumps(result))
"""


def call_in_child(function: str, kwargs: dict[str, Any], *, timeout_s: int,
                  what: str, alone: str) -> Any:
  """`function(**kwargs)` in a fresh process; its JSON-ready result.

  Args:
    function: `"module:name"`, e.g. `"tfmgpu.benchmarks.ceiling:measure"`.
    kwargs: JSON-ready keyword arguments.
    timeout_s: the longest the child may take.
    what: what the child measures, for the errors ("the ceiling
      measurement").
    alone: the command that measures the same thing alone, which the
      errors suggest.

  Raises:
    RuntimeError: the child failed (with the end of its stderr) or took
      over `timeout_s` seconds.
  """
  try:
    out = subprocess.run([sys.executable, "-c", _CHILD, function,
                          json.dumps(kwargs)], capture_output=True, text=True,
                         timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"{what} process took over {timeout_s} s; run "
                       f"`{alone}` alone to see why.") from e
  for line in out.stdout.splitlines():
    if line.startswith(_MARK):
      return json.loads(line[len(_MARK):])
  raise RuntimeError(f"{what} process failed (exit {out.returncode}); run "
                     f"`{alone}` alone to see why. Its stderr ends: "
                     f"{out.stderr[-2000:]}")
