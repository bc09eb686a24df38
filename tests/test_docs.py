"""The README cannot drift from the code: flags, strategy names, CI line."""

import glob
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

from absl import flags
import pytest

from tfmgpu import strategies

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = open(os.path.join(ROOT, "README.md")).read()
GENERATOR = os.path.join(ROOT, "scripts", "cli_reference.py")


def _load_script(path: str):
  """Imports a file under scripts/ (not a package) as a module."""
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


cli_reference = _load_script(GENERATOR)


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
  # SLURM's srun and TensorBoard's.
  named -= {"check", "help", "flagfile", "nbmake", "dist", "nodes",
            "ntasks", "num_shards",  # scripts/write_tfrecords.py's own.
            "logdir"}
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
  assert line == ('python3 -m pip install ".[dev]" && '
                  'python3 -m pytest -q -n 2 --dist loadfile')


def test_public_api_resolves_lazily():
  import tfmgpu
  for name in tfmgpu.__all__:
    assert getattr(tfmgpu, name) is not None, name
  # Issue 29 item 8: `tfmgpu.models.custom_objects()` as the README writes
  # it, after a bare `import tfmgpu` in a new process (no submodule imported).
  text = open(os.path.join(ROOT, "README.md")).read() + "".join(
      open(p).read() for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
  used = sorted(set(re.findall(r"\btfmgpu\.([a-z_]+)\.[A-Za-z_]", text)))
  assert {"models", "strategies"} <= set(used), used
  code = ("import sys, tfmgpu; print('tensorflow' in sys.modules); "
          f"print([n for n in {used!r} if not hasattr(tfmgpu, n)])")
  out = subprocess.run([__import__("sys").executable, "-c", code],
                       capture_output=True, text=True, timeout=60, check=True)
  assert out.stdout.split("\n")[:2] == ["False", "[]"], out.stdout


@pytest.mark.slow
def test_cli_reference_from_an_installed_wheel(tmp_path):
  """The generator imports the CLIs by module name, so it needs no checkout."""
  src = tmp_path / "src"  # A copy: building writes build/ and *.egg-info.
  shutil.copytree(os.path.join(ROOT, "tfmgpu"), src / "tfmgpu",
                  ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("setup.cfg", "pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
  subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-w", str(tmp_path / "wheels"), str(src)],
                 capture_output=True, text=True, timeout=120, check=True)
  (wheel,) = (tmp_path / "wheels").glob("tfmgpu-*.whl")
  site = tmp_path / "site"
  subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target",
                  str(site), str(wheel)],
                 capture_output=True, text=True, timeout=120, check=True)
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  env = dict(os.environ, PYTHONPATH=str(site))

  def run(*args):
    return subprocess.run([sys.executable, *args], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=120,
                          check=True).stdout

  where = run("-c", "import tfmgpu.launch; print(tfmgpu.__file__)")
  assert pathlib.Path(where.strip()).is_relative_to(site)
  assert run(GENERATOR).rstrip("\n") == cli_reference.markdown()


def test_what_the_readme_commands_write_is_git_ignored():
  """Issue 29 item 16: `data/` (write_tfrecords) and `preds.npy` showed up
  as untracked files after following the README."""
  if shutil.which("git") is None or not os.path.exists(
      os.path.join(ROOT, ".git")):
    pytest.skip("not a git checkout")
  paths = ["data/digits/train-00000-of-00008.tfrecord", "preds.npy",
           "p.npz", "runs/x/run.json"]
  ignored = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT,
                           capture_output=True, text=True, check=False)
  assert ignored.stdout.split() == paths, ignored
