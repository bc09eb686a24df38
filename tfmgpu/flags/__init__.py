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
* `autotune`: `--autotune` (train: off by default; bench: on).

`quiet_tensorflow`, `prepare_quiet_tensorflow` and `load_tensorflow` (from
`tfmgpu.tf_logs`) keep TensorFlow's own log lines out of CLI output.
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from tfmgpu import checks
# TensorFlow's log filtering, for the CLIs (it lives in `tfmgpu.tf_logs`).
from tfmgpu.tf_logs import load_tensorflow  # noqa: F401  # pylint: disable=unused-import
from tfmgpu.tf_logs import prepare_quiet_tensorflow  # noqa: F401  # pylint: disable=unused-import
from tfmgpu.tf_logs import quiet_tensorflow  # noqa: F401  # pylint: disable=unused-import


class _SuggestingEnumParser(flags.EnumParser):
  """absl's enum parser, whose error adds `Did you mean 'mirrored'?`."""

  def parse(self, argument: str) -> str:
    try:
      return super().parse(argument)
    except ValueError as e:
      raise ValueError(
          f"{e}.{checks.did_you_mean(argument, self.enum_values)}") from None


class _SpacedEnumFlag(flags.EnumFlag):
  """An enum flag whose `--help` lists choices as `<a | b | c>`, so that long
  lists wrap between names instead of inside one (absl joins them with a
  bare `|`, which `--help` wraps mid-word), and whose error suggests the
  nearest choice to a misspelt one."""

  def __init__(self, name: str, default: str, help_text: str,
               choices: Sequence[str]):
    super().__init__(name, default, help_text, list(choices))
    self.parser = _SuggestingEnumParser(list(choices))
    self.help = f"<{' | '.join(self.parser.enum_values)}>: {help_text}"


def define_choice(name: str, default: str, choices: Sequence[str],
                  help_text: str, *, module_name: str) -> flags.FlagHolder:
  """`flags.DEFINE_enum` with a help text that wraps between choices.

  Args:
    name, default, choices, help_text: as for `flags.DEFINE_enum`.
    module_name: the defining module's `__name__` (so that the CLIs that
      adopt the module's key flags list this one in `--help`).
  """
  if module_name == "__main__":  # absl files the main module's flags under
    module_name = sys.argv[0]    # its path (`python -m tfmgpu.train`).
  return flags.DEFINE_flag(_SpacedEnumFlag(name, default, help_text, choices),
                           module_name=module_name)
