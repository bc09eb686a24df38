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

The flags of `TrainConfig`'s fields are made from their declarations
(`tfmgpu.settings`: name, type, default, choices, bounds, help) by
`define_settings`, each group defining its names and `tfmgpu.train` the
rest; `config_values` turns the parsed flags back into `TrainConfig`'s
keyword arguments, so an option added to an `Options` dataclass reaches
the CLI and the config with no other change.

`quiet_tensorflow`, `prepare_quiet_tensorflow` and `load_tensorflow` (from
`tfmgpu.tf_logs`) keep TensorFlow's own log lines out of CLI output.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from absl import flags

from tfmgpu import checks
from tfmgpu import settings
# TensorFlow's log filtering, for the CLIs (it lives in `tfmgpu.tf_logs`).
from tfmgpu.tf_logs import load_tensorflow  # noqa: F401  # pylint: disable=unused-import
from tfmgpu.tf_logs import prepare_quiet_tensorflow  # noqa: F401  # pylint: disable=unused-import
from tfmgpu.tf_logs import quiet_tensorflow  # noqa: F401  # pylint: disable=unused-import


class _SuggestingEnumParser(flags.EnumParser):
  """absl's enum parser, whose error adds `Did you mean 'mirrored'?` (a
  choice in another case is taken, as the registered name)."""

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
    # Case-insensitive, as the registries' names are (`--strategy=Mirrored`).
    self.parser = _SuggestingEnumParser(list(choices), case_sensitive=False)
    self.help = f"<{' | '.join(self.parser.enum_values)}>: {help_text}"


def define_choice(name: str, default: str, choices: Sequence[str],
                  help_text: str, *, module_name: str,
                  flag_values: flags.FlagValues = flags.FLAGS
                  ) -> flags.FlagHolder:
  """`flags.DEFINE_enum` with a help text that wraps between choices.

  Args:
    name, default, choices, help_text: as for `flags.DEFINE_enum`.
    module_name: the defining module's `__name__` (so that the CLIs that
      adopt the module's key flags list this one in `--help`).
    flag_values: where to define it. Defaults to `flags.FLAGS`.
  """
  return flags.DEFINE_flag(_SpacedEnumFlag(name, default, help_text, choices),
                           flag_values, module_name=_module(module_name))


def _module(module_name: str) -> str:
  """absl files the main module's flags under its path (`python -m
  tfmgpu.train`), not `__main__`."""
  return sys.argv[0] if module_name == "__main__" else module_name


def _base_type(annotation: Any) -> Any:
  """`int` of `int | None`, `tuple` of `tuple[str, ...]`, ..."""
  if isinstance(annotation, types.UnionType) or (
      typing.get_origin(annotation) is typing.Union):
    annotation = next(a for a in typing.get_args(annotation)
                      if a is not type(None))
  return typing.get_origin(annotation) or annotation


def _define_one(field: dataclasses.Field, annotation: Any, module_name: str,
                flag_values: flags.FlagValues) -> flags.FlagHolder:
  """The flag of one declared field (its type chooses the flag's kind)."""
  spec = settings.declared(field)
  name, default, help_text = field.name, field.default, spec.help_text()
  if spec.choices is not None:
    return define_choice(name, default, spec.choice_list(), help_text,
                         module_name=module_name, flag_values=flag_values)
  kind = _base_type(annotation)
  common = dict(flag_values=flag_values, module_name=_module(module_name))
  bounds = {k: getattr(spec, k) for k in ("lower_bound", "upper_bound")
            if getattr(spec, k) is not None}
  if kind is bool:
    return flags.DEFINE_bool(name, default, help_text, **common)
  if kind is int:
    return flags.DEFINE_integer(name, default, help_text, **bounds, **common)
  if kind is float:
    return flags.DEFINE_float(name, default, help_text, **bounds, **common)
  if kind in (tuple, list):
    return flags.DEFINE_list(name, None if default is None else list(default),
                             help_text, **common)
  return flags.DEFINE_string(name, default, help_text, **common)


def define_settings(config: type, names: Sequence[str] | None = None, *,
                    module_name: str,
                    flag_values: flags.FlagValues = flags.FLAGS
                    ) -> dict[str, flags.FlagHolder]:
  """Defines the flags of a dataclass's declared settings.

  Args:
    config: a dataclass of `tfmgpu.settings` fields (`TrainConfig`).
    names: the fields to define, in order; `None`: every declared field
      with a flag that `flag_values` does not define yet.
    module_name: the defining module's `__name__` (`--help` lists a flag
      under the module that defines it).
    flag_values: where to define them. Defaults to `flags.FLAGS`.

  Returns:
    `{name: FlagHolder}`.
  """
  fields = {f.name: (f, t) for f, t in settings.fields_of(config)}
  if names is None:
    names = [n for n, (f, _) in fields.items() if n not in flag_values
             and settings.declared(f) is not None
             and settings.declared(f).flag]
  return {n: _define_one(*fields[n], module_name, flag_values) for n in names}


def config_values(config: type,
                  flag_values: flags.FlagValues = flags.FLAGS
                  ) -> dict[str, Any]:
  """The parsed flags named like `config`'s fields: `config(**values)`'s
  arguments (a flag left `None` keeps the field's default)."""
  return {f.name: flag_values[f.name].value
          for f in dataclasses.fields(config)
          if f.name in flag_values and flag_values[f.name].value is not None}


def values_of(holders: dict[str, flags.FlagHolder]) -> dict[str, Any]:
  """`{name: value}` of parsed flags, lists as tuples (an empty one, as
  `--devices=` gives, as `None`): option values."""
  return {name: (tuple(h.value) or None) if isinstance(h.value, list)
          else h.value for name, h in holders.items()}
