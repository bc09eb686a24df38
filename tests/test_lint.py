"""The package and its tests pass the linter configured in pyproject.toml.

`ruff check tfmgpu tests` (rules and exceptions: `[tool.ruff]` in
pyproject.toml) runs when ruff is installed, as it is with the `dev` extras
that CI installs; without it the test is skipped and says how to get it.
"""

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _ruff() -> list[str] | None:
  """The command that runs ruff, or `None` when it is not installed."""
  if importlib.util.find_spec("ruff") is not None:
    return [sys.executable, "-m", "ruff"]
  found = shutil.which("ruff")
  return [found] if found else None


def test_ruff_check_passes():
  ruff = _ruff()
  if ruff is None:
    pytest.skip('ruff is not installed: pip install -e ".[dev]" (or ruff).')
  proc = subprocess.run([*ruff, "check", "--no-cache", "tfmgpu", "tests"],
                        cwd=ROOT, capture_output=True, text=True,
                        timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, (
      "ruff check found problems (fix them, or add a justified exception "
      "to [tool.ruff] in pyproject.toml):\n" + proc.stdout + proc.stderr)


def test_the_config_selects_rules_and_is_read(tmp_path):
  ruff = _ruff()
  if ruff is None:
    pytest.skip('ruff is not installed: pip install -e ".[dev]" (or ruff).')
  bad = tmp_path / "bad.py"
  bad.write_text("import os\nl = lambda: 1\n")
  proc = subprocess.run(
      [*ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
       str(bad)], capture_output=True, text=True, timeout=TIMEOUT_S,
      check=False)
  assert proc.returncode == 1
  assert "F401" in proc.stdout  # Selected: the unused import.
  assert "E731" not in proc.stdout and "E741" not in proc.stdout  # Ignored.
