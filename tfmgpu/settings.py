"""Declared settings: one dataclass field says everything about an option.

An option of a run (a `TrainConfig` field) or of a distribution (a field of
its `Options` dataclass) is declared once, with `setting(...)`: its name and
type are the field's, and the field's metadata holds its help text, choices,
bounds, the default a run uses when it differs from the dataclass's, and
whether `run.json` records it. From that one declaration come the
`TrainConfig` field (`tfmgpu.config`), the CLI flag (`tfmgpu.flags`), the
config's docstring and the options a distribution receives.

Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Iterator, Sequence
from typing import Any, Callable

_KEY = "tfmgpu"  # The metadata key of a declared setting.
# `run_default` when a run uses the dataclass field's own default.
SAME = type("SameDefault", (), {"__repr__": lambda self: "SAME"})()


class Record(str, enum.Enum):
  """Whether `run.json` names a placement's option (resuming compares it)."""
  VALUE = "value"  # Recorded unless `None`.
  SIZE = "size"    # Recorded unless `None` or 1 (a layout size not used).


@dataclasses.dataclass(frozen=True)
class Setting:
  """What one field declares beyond its name, type and default.

  Attributes:
    help: one line or more for `--help`, the README and the docstring (a
      callable: read when the flag is made, for lists from a registry).
    choices: the allowed values (a callable: read when the flag is made).
    lower_bound, upper_bound: bounds of a number.
    run_default: the default of a run (`TrainConfig` and the flag) when it
      differs from the dataclass field's.
    record: `Record.VALUE` / `Record.SIZE` to name it in `run.json`'s
      `placement`; `None`: not recorded.
    flag: whether a CLI flag exists for it.
  """
  help: str | Callable[[], str]
  choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
  lower_bound: float | None = None
  upper_bound: float | None = None
  run_default: Any = SAME
  record: Record | None = None
  flag: bool = True

  def help_text(self) -> str:
    """The help, read now."""
    return self.help() if callable(self.help) else self.help

  def choice_list(self) -> list[str] | None:
    """The choices, read now (`None`: any value)."""
    if self.choices is None:
      return None
    return list(self.choices() if callable(self.choices) else self.choices)


def setting(default: Any, help: str | Callable[[], str], *,  # pylint: disable=redefined-builtin
            choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
            lower_bound: float | None = None,
            upper_bound: float | None = None,
            run_default: Any = SAME,
            record: Record | None = None,
            flag: bool = True) -> Any:
  """A dataclass field declaring one option (see `Setting`).

  Example:

    @dataclasses.dataclass(frozen=True)
    class PipelineOptions:
      micro_batches: int = setting(4, "Micro-batches per step.",
                                   lower_bound=1)
  """
  return dataclasses.field(default=default, metadata={_KEY: Setting(
      help, choices, lower_bound, upper_bound, run_default, record, flag)})


def with_default(cls: type, name: str, default: Any) -> Any:
  """The field `name` of the dataclass `cls`, declared again with another
  default (a subclass's own default for an option it shares)."""
  field = {f.name: f for f in dataclasses.fields(cls)}[name]
  return dataclasses.field(default=default, metadata=field.metadata)


def declared(field: dataclasses.Field) -> Setting | None:
  """The `Setting` a field declares (`None`: a plain field)."""
  return field.metadata.get(_KEY)


def run_default(field: dataclasses.Field) -> Any:
  """The default a run uses for `field`."""
  spec = declared(field)
  if spec is not None and spec.run_default is not SAME:
    return spec.run_default
  return field.default


def fields_of(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
  """`(field, type)` of each field of the dataclass `cls`, types resolved."""
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    yield field, hints[field.name]


def recorded(options: Any) -> list[tuple[str, Any]]:
  """`(name, value)` of the options `run.json` names: `Record.VALUE` ones
  first, then `Record.SIZE` ones, each group in field order."""
  found = []
  for kind, skip in ((Record.VALUE, (None,)), (Record.SIZE, (None, 1))):
    for field in dataclasses.fields(options):
      spec = declared(field)
      value = getattr(options, field.name)
      if spec is not None and spec.record is kind and value not in skip:
        found.append((field.name, value))
  return found
