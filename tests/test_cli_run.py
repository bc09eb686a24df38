"""`tfmgpu.flags.cli`: help that exits 0, key flags of an installed script."""

import sys

from absl import flags
import pytest

from tfmgpu import train  # noqa: F401  (defines the flags)
from tfmgpu.flags import cli


@pytest.mark.parametrize("name", ["help", "helpshort", "helpfull"])
def test_asking_for_help_exits_0(name, capsys):
  cli.define_help_flags()
  cli.define_help_flags()  # Idempotent.
  with pytest.raises(SystemExit) as exit_:
    flags.FLAGS[name].parse("true")
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert ("--strategy" if name == "helpfull" else "Try --helpfull") in out


def test_a_console_script_lists_the_clis_key_flags(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["/somewhere/bin/tfmgpu-train-test"])
  assert "--strategy" not in flags.FLAGS.main_module_help()
  cli.adopt_for_main("tfmgpu.train")
  listed = flags.FLAGS.main_module_help()
  for flag in ("--strategy", "--model", "--virtual_devices", "--epochs"):
    assert flag in listed, flag


def test_a_bad_setting_is_one_error_line_not_the_whole_help(capsys,
                                                           monkeypatch):
  """A setting `main` refuses (`app.UsageError`) is said in one line; absl
  alone would print the module's docstring and every flag before it."""
  from absl import app  # pylint: disable=g-import-not-at-top

  def main(argv):
    del argv
    raise app.UsageError("zero_stage=2 is not supported by strategy="
                         "'pipeline'.")

  monkeypatch.setattr(sys, "argv", ["tfmgpu-train"])
  with pytest.raises(SystemExit) as exit_:
    cli.run(main, "tfmgpu.train")
  assert exit_.value.code == 1
  err = capsys.readouterr().err
  assert err.startswith("error: zero_stage=2 is not supported")
  assert len(err.strip().splitlines()) == 2, err


def test_ctrl_c_a_cli_does_not_handle_is_one_line_exit_130(capsys,
                                                           monkeypatch):
  """Ctrl-C in `generate`'s token stream or a `bench` section printed a
  KeyboardInterrupt traceback (train and predict say what they kept)."""

  def main(argv):
    del argv
    print("def f(", end="")  # A streamed line left open.
    raise KeyboardInterrupt

  monkeypatch.setattr(sys, "argv", ["tfmgpu-generate"])
  with pytest.raises(SystemExit) as exit_:
    cli.run(main, "tfmgpu.generate")
  assert exit_.value.code == 130
  captured = capsys.readouterr()
  assert captured.out == "def f("
  assert captured.err == "\nerror: interrupted (Ctrl-C).\n"
