"""TensorFlow's own log lines kept out of tfmgpu's output.

`import tfmgpu` sets `TF_CPP_MIN_LOG_LEVEL=3` when the user set none and
TensorFlow is not loaded yet (`quiet_by_default`): TF's C++ start-up lines
(a CPU host's red `E0000 ... failed call to cuInit`, oneDNN and CUDA notes)
are noise for a library user as for the CLIs. The CLIs then call
`quiet_tensorflow` (or `prepare_quiet_tensorflow` and `load_tensorflow`
apart), which also filters TF's Python INFO records, prints TF's start-up
lines once (two copies of its runtime log them), and gives the default
back for `--verbose=2`.

Imports only the standard library: `tfmgpu/__init__.py` imports it.
"""

from __future__ import annotations

import importlib.util
import logging as py_logging
import os
import re
import sys
import tempfile

# Whether `quiet_by_default` set TF_CPP_MIN_LOG_LEVEL (not the user).
_QUIETED = False


def quiet_by_default() -> None:
  """Sets `TF_CPP_MIN_LOG_LEVEL=3` unless the user set it or TensorFlow is
  loaded already (it reads the level once, when it loads)."""
  global _QUIETED
  if "tensorflow" not in sys.modules and "TF_CPP_MIN_LOG_LEVEL" not in (
      os.environ):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    _QUIETED = True


# One record of TF's C++ logging: `E0000 00:00:1796258865.469782   29897
# cuda_platform.cc:52] failed call to cuInit: ...`.
_CPP_RECORD = re.compile(r"([IWEF])\d{4} \d\d:\d\d:[\d.]+ +\d+ [^\s\]]+:\d+\] ")
# Written by each copy of absl's C++ logging before its first record.
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog()"


def quiet_tensorflow(*, tensorflow_logs: bool = False) -> None:
  """Keeps TensorFlow's own log messages out of CLI output and loads it.

  `prepare_quiet_tensorflow`, then `load_tensorflow`: call before TF loads.
  A CLI with checks that need no TensorFlow calls the two apart, so that
  its errors come before the seconds TF takes to load.

  Args:
    tensorflow_logs: leave TF's logging at its defaults (`--verbose=2`),
      only dropping the repeated start-up lines.
  """
  prepare_quiet_tensorflow(tensorflow_logs=tensorflow_logs)
  load_tensorflow()


def prepare_quiet_tensorflow(*, tensorflow_logs: bool = False) -> None:
  """Sets up the quiet of `quiet_tensorflow` without importing TensorFlow.

  Quiet (the default): sets `TF_CPP_MIN_LOG_LEVEL=3` unless the user set it
  (C++ INFO, WARNING and ERROR lines such as a CPU host's `failed call to
  cuInit` are hidden; real failures still surface as Python exceptions),
  and keeps TF's Python INFO records (`Sharding callback duration` after
  every checkpoint), its checkpoint writer's retracing warnings and a known
  tf.data warning out. Nothing is imported:
  `load_tensorflow` (or the first import of TF after this call, unfiltered)
  loads it when a command gets that far.

  Args:
    tensorflow_logs: leave TF's logging at its defaults (`--verbose=2`).
  """
  if not tensorflow_logs:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    _quiet_python_logs()
  elif _QUIETED and "tensorflow" not in sys.modules:
    os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)  # `quiet_by_default`'s.


def load_tensorflow() -> None:
  """Imports TensorFlow with its start-up records below
  `TF_CPP_MIN_LOG_LEVEL` filtered from stderr, and its start-up lines
  printed once: `import tensorflow` loads two copies of TF's runtime
  (`libtensorflow_framework.so.2` and the profiler's
  `_pywrap_profiler_plugin.so`), each of which logs them. Does nothing
  when TensorFlow is loaded already."""
  _import_tensorflow_filtered(_min_log_level())


def _quiet_python_logs() -> None:
  """TF's Python INFO records and a known tf.data warning, filtered out."""
  import warnings  # pylint: disable=g-import-not-at-top
  py_logging.getLogger("tensorflow").setLevel(py_logging.WARNING)
  warnings.filterwarnings(
      "ignore", message="To make it possible to preserve tf.data options")
  for name in ("absl", "tensorflow"):  # TF's own records use the second.
    logger = py_logging.getLogger(name)
    if not any(isinstance(f, _TensorFlowInfoFilter) for f in logger.filters):
      logger.addFilter(_TensorFlowInfoFilter())


# TF's warning that its own checkpoint writer's function retraced (each
# save of a parameter-server run): nothing a user wrote, nothing to do.
_OWN_RETRACING = re.compile(r"calls to <function MultiDeviceSaver\.save\.")


class _TensorFlowInfoFilter(py_logging.Filter):
  """Drops absl INFO records logged from TensorFlow's own Python files, and
  TF's warnings that its own checkpoint writer retraced (a user's function
  that retraces is still said)."""

  def __init__(self):
    super().__init__()
    spec = importlib.util.find_spec("tensorflow")
    locations = list(spec.submodule_search_locations or []) if spec else []
    self._prefixes = tuple(os.path.join(p, "") for p in locations)

  def filter(self, record: py_logging.LogRecord) -> bool:
    if not (self._prefixes and record.pathname.startswith(self._prefixes)):
      return True
    return not (record.levelno < py_logging.WARNING
                or _OWN_RETRACING.search(record.getMessage()))


def _min_log_level() -> int:
  """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it (0 when unset or invalid)."""
  try:
    return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
  except ValueError:
    return 0


def filter_startup_log(text: str, min_level: int) -> str:
  """What of TF's start-up stderr `text` to show at `min_level`.

  Args:
    text: what TensorFlow wrote to stderr while it was imported.
    min_level: `TF_CPP_MIN_LOG_LEVEL` (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL).

  Returns:
    `text` without C++ records below `min_level`, without absl's
    pre-initialisation banner when `min_level > 0`, and without any record
    or banner already shown (the second runtime copy repeats them). Other
    lines (Python warnings, unknown output) are kept.
  """
  seen: set[str] = set()
  kept = []
  for line in text.splitlines(keepends=True):
    match = _CPP_RECORD.match(line)
    if line.startswith(_ABSL_BANNER):
      if min_level > 0 or _ABSL_BANNER in seen:
        continue
      seen.add(_ABSL_BANNER)
    elif match:
      body = line[match.end():]
      if "IWEF".index(match.group(1)) < min_level or body in seen:
        continue
      seen.add(body)
    kept.append(line)
  return "".join(kept)


def _import_tensorflow_filtered(min_level: int) -> None:
  """Imports TensorFlow with its start-up stderr passed through the filter.

  The C++ runtime writes to file descriptor 2 directly, so the descriptor is
  pointed at a temporary file for the import. If the import fails, all of
  it is shown unfiltered.
  """
  if "tensorflow" in sys.modules:
    return
  sys.stderr.flush()
  with tempfile.TemporaryFile() as captured:
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    failed = True
    try:
      import tensorflow  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
      failed = False
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      text = captured.read().decode(errors="replace")
      sys.stderr.write(text if failed else filter_startup_log(text, min_level))
      sys.stderr.flush()
