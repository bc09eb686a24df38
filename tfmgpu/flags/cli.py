"""`run`: `app.run(main)` for a CLI, the same by `python -m` or installed.

An installed console script (`tfmgpu-train`, entry point `tfmgpu.train:run`)
runs with a wrapper as the main module, so absl's `--help`, which lists the
main module's key flags, listed none. `run` gives the wrapper the CLI's key
flags and docstring. absl's `--help` and `--helpfull` exit 1; here asking
for help succeeds (exit 0).
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

from absl import app
from absl import flags


def _exit_after_help() -> None:
  sys.stdout.flush()
  sys.exit(0)


class _HelpFlag(app.HelpFlag):
  """`--help` / `-?`: the main module's flags, then exit 0."""

  def parse(self, arg):
    if self._parse(arg):
      app.usage(shorthelp=True, writeto_stdout=True)
      print()
      print("Try --helpfull to get a list of all flags.")
      _exit_after_help()


class _HelpshortFlag(_HelpFlag):
  """`--helpshort`: an alias of `--help`."""
  NAME = "helpshort"
  SHORT_NAME = None


class _HelpfullFlag(app.HelpfullFlag):
  """`--helpfull`: every flag, then exit 0."""

  def parse(self, arg):
    if self._parse(arg):
      app.usage(writeto_stdout=True)
      _exit_after_help()


def define_help_flags() -> None:
  """Replaces absl's `--help`, `--helpshort` and `--helpfull` (exit 1) by
  ones that exit 0. Idempotent."""
  app.define_help_flags()  # absl's, so that `app.run` adds none later.
  for flag in (_HelpFlag(), _HelpshortFlag(), _HelpfullFlag()):
    if not isinstance(flags.FLAGS[flag.name], type(flag)):
      flag.allow_override = True
      flags.DEFINE_flag(flag, module_name="absl.app")


def adopt_for_main(module_name: str) -> None:
  """Makes the CLI module `module_name`'s key flags and docstring those of
  the main module (a console-script wrapper), for `--help`.

  Args:
    module_name: the CLI module's `__name__`; `"__main__"` (run by
      `python -m`) needs nothing.
  """
  if module_name == "__main__":
    return
  main = sys.argv[0]  # The name absl files the main module's flags under.
  for flag in flags.FLAGS.get_key_flags_for_module(module_name):
    flags.FLAGS.register_key_flag_for_module(main, flag)
  wrapper = sys.modules.get("__main__")
  if wrapper is not None and not getattr(wrapper, "__doc__", None):
    wrapper.__doc__ = sys.modules[module_name].__doc__


def run(main: Callable[[list[str]], int | None], module_name: str) -> None:
  """`absl.app.run(main)` for the CLI module `module_name` (its `__name__`),
  with a full `--help` that exits 0 however it was started, a bad setting
  `main` reports (`app.UsageError`) said in one `error:` line (absl would
  print the module's whole help before it), and a Ctrl-C that `main` does
  not handle itself said in one line, exit 130 (Python would print a
  traceback)."""
  adopt_for_main(module_name)
  define_help_flags()
  app.run(functools.partial(_one_line_errors, main))


# The shell's exit status for a process stopped by SIGINT (128 + 2).
INTERRUPTED_EXIT_CODE = 130


def _one_line_errors(main: Callable[[list[str]], int | None],
                     argv: list[str]) -> int | None:
  """`main(argv)`; a `UsageError` printed as `error: ...` and a pointer to
  the flags' help, exiting with its exit code; a Ctrl-C as one line."""
  try:
    return main(argv)
  except app.UsageError as e:
    print(f"error: {e}\nTry --helpshort (this CLI's flags) or --helpfull.",
          file=sys.stderr)
    return e.exitcode
  except KeyboardInterrupt:  # E.g. generate's stream or a bench section.
    sys.stdout.flush()  # A line left open (streamed tokens) ends first.
    print("\nerror: interrupted (Ctrl-C).", file=sys.stderr)
    return INTERRUPTED_EXIT_CODE
