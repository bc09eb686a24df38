"""Flag groups of the CLIs, each defined once.

A CLI imports the groups it reads, and only those, so no CLI accepts a flag
it ignores; a flag shared by several CLIs has one name, help and choice
list (choices come from the registries). Two CLIs can be imported in one
process. Library code never imports this package.

* `devices`: `--virtual_devices` (train, predict, bench).
* `strategy`: `--strategy` and the replica-device options (train, predict).
* `data`: `--dataset`, `--data_path` (train, predict).
* `stages`: how a model is cut into stages (train, predict).
* `execution`: `--steps_per_execution` (train, predict, bench).
* `batch`: `--global_batch_size` (train, bench).
"""

from __future__ import annotations

from typing import Sequence

from absl import flags


class _SpacedEnumFlag(flags.EnumFlag):
  """An enum flag whose `--help` lists choices as `<a | b | c>`, so that long
  lists wrap between names instead of inside one (absl joins them with a
  bare `|`, which `--help` wraps mid-word)."""

  def __init__(self, name: str, default: str, help_text: str,
               choices: Sequence[str]):
    super().__init__(name, default, help_text, list(choices))
    self.help = f"<{' | '.join(self.parser.enum_values)}>: {help_text}"


def define_choice(name: str, default: str, choices: Sequence[str],
                  help_text: str, *, module_name: str) -> flags.FlagHolder:
  """`flags.DEFINE_enum` with a help text that wraps between choices.

  Args:
    name, default, choices, help_text: as for `flags.DEFINE_enum`.
    module_name: the defining module's `__name__` (so that the CLIs that
      adopt the module's key flags list this one in `--help`).
  """
  return flags.DEFINE_flag(_SpacedEnumFlag(name, default, help_text, choices),
                           module_name=module_name)


def quiet_tensorflow() -> None:
  """Keeps TF's INFO chatter and a known tf.data warning out of CLI output."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  py_logging.getLogger("tensorflow").setLevel(py_logging.WARNING)
  warnings.filterwarnings(
      "ignore", message="To make it possible to preserve tf.data options")
