"""`python -m tfmgpu.train`: in-process with flagsaver, and real subprocesses."""

import os
import re
import subprocess
import sys
import time

from absl import flags
from absl.testing import flagsaver
import pytest

import tfmgpu
from tfmgpu import train



pytestmark = pytest.mark.usefixtures("parsed_flags")


@pytest.mark.slow
def test_readme_command_reaches_the_accuracy_and_saves(tmp_path, capsys):
  """Acceptance: the README's `--strategy=mirrored --virtual_devices=2
  --epochs=5` (2 replicas), in-process: >= 0.93, the model and its
  checkpoints saved. tests/test_readme_blocks.py runs the command itself
  as a subprocess (its flag path, no TF log line); a subprocess here only
  paid TensorFlow's import again for the same training."""
  start = time.perf_counter()
  with flagsaver.flagsaver(strategy="mirrored", num_replicas=2, epochs=5,
                           model_dir=str(tmp_path), verbose=0):
    assert train.main(["train"]) == 0
  seconds = time.perf_counter() - start
  out = capsys.readouterr().out
  assert re.search(r"replicas\s+2 on /device:CPU:0, /device:CPU:1", out), out
  accuracy = float(re.search(r"test loss / accuracy\s+[\d.]+ / ([\d.]+)",
                             out).group(1))
  assert accuracy >= 0.93, out
  assert (tmp_path / "model.keras").exists()
  assert (tmp_path / "checkpoints" / "checkpoint").exists()
  print(f"README command: {seconds:.0f} s")


@pytest.mark.parametrize("strategy", ["mirrored", "auto"])
def test_one_run_looks_the_strategy_up_once(strategy, tmp_path, monkeypatch):
  """Issue 25: `--strategy` is resolved once per run: by the flag check at
  parsing, whose distribution the config reuses and hands down; `auto`'s
  chosen layout needs no second lookup."""
  from tfmgpu import strategies
  from tfmgpu.strategies import registry
  looked_up = []
  lookup = registry.lookup

  def counted(name):
    looked_up.append(name)
    return lookup(name)

  argv = ["train", f"--strategy={strategy}", "--model=mlp", "--epochs=1",
          "--steps_per_epoch=2", "--verbose=0", f"--model_dir={tmp_path}"]
  with flagsaver.flagsaver():
    with monkeypatch.context() as patch:
      patch.setattr(registry, "lookup", counted)
      patch.setattr(strategies, "lookup", counted)
      flags.FLAGS(argv)  # Parsed as the CLI parses: the validators run.
      assert train.main(["train"]) == 0
  assert looked_up == [strategy]


def test_config_errors_become_usage_errors():
  from absl import app
  with flagsaver.flagsaver(strategy="mirrored", dataset="npz", data_path=None):
    with pytest.raises(app.UsageError, match=r"dataset='npz' needs data_path"):
      train.main(["train"])


def test_library_errors_exit_1_with_the_message(capsys):
  with flagsaver.flagsaver(strategy="mirrored", num_gpus=2, verbose=0):
    assert train.main(["train"]) == 1
  assert "num_gpus=2 but this machine has 0 GPU(s)" in capsys.readouterr().err


def test_a_run_that_fails_before_writing_anything_leaves_no_directory(
    tmp_path, capsys):
  """Issue 29 item 8: a failed run left `runs/<time>-auto/` with only its
  run.json. Directories it created are removed; one it found is kept."""
  new = tmp_path / "runs" / "x"
  with flagsaver.flagsaver(strategy="mirrored", num_gpus=2, verbose=0,
                           model_dir=str(new)):
    assert train.main(["train"]) == 1
  assert "num_gpus=2" in capsys.readouterr().err
  assert os.listdir(tmp_path) == []
  kept = tmp_path / "kept"
  kept.mkdir()
  with flagsaver.flagsaver(strategy="mirrored", num_gpus=2, verbose=0,
                           model_dir=str(kept)):
    assert train.main(["train"]) == 1
  assert os.listdir(kept) == ["run.json"]


def test_help_and_flag_errors_answer_before_tensorflow_loads():
  code = ("import sys, tfmgpu.train, tfmgpu.config;"
          "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, check=True)
  assert out.stdout.split() == ["False", "False"]
  # `-X importtime` lists every import on stderr: each error must come
  # without TensorFlow ever being imported.
  train_cli = [sys.executable, "-X", "importtime", "-m", "tfmgpu.train"]
  bad = subprocess.run([*train_cli, "--strategy=bogus"],
                       capture_output=True, text=True, timeout=60, check=False)
  assert bad.returncode == 1
  assert "value should be one of" in bad.stderr and "mirrored" in bad.stderr
  indivisible = subprocess.run(
      [*train_cli, "--virtual_devices=4", "--global_batch_size=30"],
      capture_output=True, text=True, timeout=60, check=False)
  assert indivisible.returncode == 1
  assert "--global_batch_size=30 is not divisible by the 4 replicas" in (
      indivisible.stderr)
  for run in (bad, indivisible):
    assert not re.search(r"\|\s*tensorflow$", run.stderr, re.M), run.stderr


def test_flagfile(tmp_path):
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("--strategy=one_device\n--global_batch_size=33\n")
  args = flags.FLAGS.read_flags_from_files([f"--flagfile={flagfile}"])
  assert args == ["--strategy=one_device", "--global_batch_size=33"]
  with flagsaver.flagsaver():
    for arg in args:
      name, value = arg[2:].split("=", 1)
      flags.FLAGS[name].parse(value)
    config = train.config_from_flags()
  assert (config.strategy, config.global_batch_size) == ("one_device", 33)


# How pip's console-script wrapper runs `tfmgpu-train` (entry point
# `tfmgpu.train:run`): the main module is the wrapper, not tfmgpu.train.
_CONSOLE_SCRIPT = ("import sys; sys.argv[0] = '/usr/local/bin/tfmgpu-train'; "
                   "from tfmgpu.train import run; sys.exit(run())")


@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_help_lists_the_flags_a_user_needs_and_wraps_between_names(how):
  """Issue 29 item 12: the installed script's `--help` listed no flag, and
  `--help` exited 1."""
  command = (["-m", "tfmgpu.train"] if how == "python -m"
             else ["-c", _CONSOLE_SCRIPT])
  proc = subprocess.run([sys.executable, *command, "--help"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert "Train a model on many devices" in out
  for flag in ("--strategy", "--virtual_devices", "--model",
               "--global_batch_size", "--epochs", "--num_stages"):
    assert re.search(rf"^\s+{flag}:", out, re.M), flag
  choices = re.search(r"--strategy: <([^>]*)>", out, re.S).group(1)
  names = [n.strip() for n in choices.replace("\n", " ").split("|")]
  assert names == list(tfmgpu.available_strategies())


@pytest.mark.parametrize("flag, given, meant", [
    ("strategy", "mirored", "mirrored"), ("optimizer", "adamw_", "adamw"),
    ("schedule", "1f1", "1f1b"), ("model", "convnt", "convnet")])
def test_a_misspelt_choice_says_which_was_meant(flag, given, meant):
  """Issue 29 item 12: `--strategy=mirored` got no "did you mean"."""
  with pytest.raises(flags.IllegalFlagValueError,
                     match=rf"Did you mean '{meant}'\?"):
    with flagsaver.flagsaver():
      flags.FLAGS[flag].parse(given)
      flags.FLAGS.validate_all_flags()


def test_a_choice_in_another_case_is_the_registered_name():
  """The README: names are case-insensitive (the Python API's were; the
  flag refused `--strategy=Pipeline`)."""
  with flagsaver.flagsaver():
    flags.FLAGS["strategy"].parse("Pipeline")
    assert flags.FLAGS.strategy == "pipeline"
