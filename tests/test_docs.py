"""The README cannot drift from the code: flags, strategy names, CI line."""

import os
import re
import subprocess

from absl import flags

from tfmgpu import cli_reference, strategies

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = open(os.path.join(ROOT, "README.md")).read()


def test_cli_reference_is_generated_from_the_real_flags():
  start = README.index(cli_reference.BEGIN)
  end = README.index(cli_reference.END) + len(cli_reference.END)
  assert README[start:end] == cli_reference.markdown(), (
      "README's CLI reference is stale: run "
      "python scripts/update_cli_reference.py")


def test_every_flag_named_in_the_readme_exists():
  cli_reference.markdown()  # Imports every CLI module, defining its flags.
  named = set(re.findall(r"--([a-z][a-z0-9_]+)", README))
  # Options of other programs: this repo's scripts' own, absl's, pytest's,
  # and SLURM's srun.
  named -= {"check", "help", "flagfile", "nbmake", "nodes", "ntasks"}
  missing = sorted(n for n in named if n not in flags.FLAGS)
  assert not missing, f"README names flags that do not exist: {missing}"


def test_every_registered_strategy_is_in_the_table():
  table = README[README.index("| name | kind |"):]
  table = table[:table.index("\n\n")]
  rows = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M))
  assert rows == set(strategies.available_strategies())


def test_ci_runs_the_readme_test_line():
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  assert "ci:test-command" in ci
  line = subprocess.run(
      ["awk", "/<!-- ci:test-command -->/{getline; getline; print; exit}",
       os.path.join(ROOT, "README.md")], capture_output=True, text=True,
      check=True).stdout.strip()
  assert line == 'python3 -m pip install ".[dev]" && python3 -m pytest -q'


def test_public_api_resolves_lazily():
  import tfmgpu
  for name in tfmgpu.__all__:
    assert getattr(tfmgpu, name) is not None, name
  code = "import sys, tfmgpu; print('tensorflow' in sys.modules)"
  out = subprocess.run([__import__("sys").executable, "-c", code],
                       capture_output=True, text=True, timeout=60, check=True)
  assert out.stdout.strip() == "False"
