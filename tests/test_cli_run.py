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
