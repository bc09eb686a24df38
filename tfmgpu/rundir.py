"""A run directory (`--model_dir`): one live run at a time, and its record.

**Lock.** A run that trains in a directory holds `MODEL_DIR/run.lock`: an
exclusive `flock` on the file, which records the host, PID, start time and
command of the run. A second run on the directory refuses, naming them
(`RunDirLockedError`). The kernel drops the `flock` when its process dies,
however it dies, so a lock file left by a dead run on this host is seen to
be stale, reported and taken over. A lock file naming another host whose
lock is free cannot be checked from here: the run refuses and says which
file to delete if that run is gone. The lock is reentrant within a process
(`python -m tfmgpu.train` holds it around `Trainer.fit`, which takes it
too) and released when the run ends, also on `PreemptedError` (exit 42).
In a cluster only the chief takes it. If the directory is deleted while the
run lives, the next checkpoint save puts the lock and the record back
(`keep_run_dir`), with a warning; if another run has taken the
directory meanwhile, the save refuses (`RunDirLockedError`).

**Record.** `run.json` records what a run is: model, optimizer, global
batch, seed, dataset, placement (and a pipeline's micro-batches), learning
rate, epochs, and the versions of tfmgpu, TensorFlow and Keras. It is
written (atomically) when a directory is first used. A resume compares: a
change of what the checkpoints depend on (`FIXED`) is refused with one line
per field, `old -> new` (`RunRecordMismatchError`); a change of what may
change (`CHANGEABLE`: learning rate, epochs, steps per epoch, loss, metrics)
is applied and logged, and the record updated once a checkpoint restores.
The layout (`MOVABLE`: placement, micro-batches) may change when both runs'
checkpoints are portable (`portable` in the record: the weights by layer
name, e.g. a `mirrored --zero_stage=3` run resumed as `pipeline
--num_stages=2`). A directory without checkpoints holds no run yet: its
record is simply rewritten. A directory
with checkpoints but no record (deleted, or an empty file) gets one only
after a checkpoint restores into the run (`confirm_record`, called by the
training loop); a record naming none of the settings (`{}`) is refused.

Importing this module imports nothing heavy (no TensorFlow).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import importlib.metadata
import json
import os
import re
import shlex
import socket
import sys
from collections.abc import Mapping
from typing import Any

from absl import logging

from tfmgpu import files
from tfmgpu import user_code

LOCK_NAME = "run.lock"
RECORD_NAME = "run.json"
# What checkpoints depend on: never changed by a resume.
FIXED = ("model", "model_size", "optimizer", "global_batch_size", "seed",
         "dataset", "placement", "micro_batches")
# What a resume may change: applied from then on, and logged.
CHANGEABLE = ("learning_rate", "epochs", "steps_per_epoch", "loss", "metrics")
_FLAG_OF = {"placement": "strategy"}  # The flag that sets a record field.
# What a resume may change when both runs' checkpoints are portable (they
# carry the weights by layer name, `tfmgpu.training.portable`): the layout.
MOVABLE = ("placement", "micro_batches")
# Chief's records waiting for a checkpoint to restore (run.json was missing):
# real path of the model_dir -> the record to write then.
_UNCONFIRMED: dict[str, dict[str, Any]] = {}
# Chief's record updates of a resume (a changed epochs, ...), written once
# a checkpoint restores: real path of the model_dir -> the updated record.
_UPDATES: dict[str, dict[str, Any]] = {}
_CHECKPOINT = re.compile(r"^ckpt-\d+[._]")
# The record of each model_dir this process runs in, as it stands (real
# path -> record): put back by `keep_run_dir` if the file is deleted.
_RECORDS: dict[str, dict[str, Any]] = {}


class RunDirError(ValueError):
  """A run directory that cannot be used as asked (the message says why)."""


class RunDirLockedError(RunDirError):
  """Another live run holds the directory's lock."""


class RunRecordMismatchError(RunDirError):
  """A resume changes settings that the directory's checkpoints depend on."""


def default_model_dir(strategy: str) -> str:
  """A fresh run directory, `runs/<time>-<strategy>` (never resumes by accident)."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
  return os.path.join("runs", f"{stamp}-{strategy}")


def prepare_model_dir(model_dir: str) -> str:
  """Creates `model_dir` if needed; returns it.

  Raises:
    RunDirError: it is a file, or cannot be created (the message says why).
  """
  if os.path.exists(model_dir) and not os.path.isdir(model_dir):
    raise RunDirError(
        f"model_dir={model_dir!r} is a regular file, not a directory. Give "
        "a directory: a new path, or the model_dir of the run to resume.")
  try:
    os.makedirs(model_dir, exist_ok=True)
  except OSError as e:
    raise RunDirError(
        f"model_dir={model_dir!r} cannot be created ({e.strerror or e}). "
        "Choose a path in a writable directory.") from e
  return model_dir


def missing_directories(model_dir: str) -> list[str]:
  """`model_dir` and those of its parents that do not exist, deepest first."""
  missing = []
  path = os.path.normpath(model_dir)
  while path and not os.path.exists(path):
    missing.append(path)
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return missing


def remove_unused(created: list[str]) -> list[str]:
  """Removes the directories a failed run created, if it left nothing else.

  Args:
    created: `missing_directories(model_dir)` from before the run, deepest
      first. Each is removed if it holds only the run's record and lock (or
      nothing); the first that holds more is kept, with its parents.

  Returns:
    The directories removed.
  """
  removed = []
  for path in created:
    try:
      entries = set(os.listdir(path))
      if not entries <= {RECORD_NAME, LOCK_NAME}:
        break
      for name in entries:
        os.remove(os.path.join(path, name))
      os.rmdir(path)
    except OSError:  # Gone, or written by someone else meanwhile: keep.
      break
    removed.append(path)
  return removed


def has_checkpoints(model_dir: str) -> bool:
  """Whether `model_dir/checkpoints` holds any checkpoint file."""
  directory = os.path.join(model_dir, "checkpoints")
  return os.path.isdir(directory) and any(
      _CHECKPOINT.match(f) for f in os.listdir(directory))


# ---------------------------------------------------------------- lock

_HELD: dict[str, list] = {}  # Lock path (real) -> [fd, holders] in-process.


def _command() -> str:
  """This process's command line, `python -m tfmgpu.train ...` for a CLI."""
  argv = list(sys.argv) or [""]
  package = os.path.dirname(os.path.abspath(__file__))
  first = os.path.abspath(argv[0]) if argv[0] else ""
  if first.startswith(package + os.sep) and first.endswith(".py"):
    module = os.path.relpath(first[:-3], os.path.dirname(package))
    argv = ["-m", module.replace(os.sep, "."), *argv[1:]]
  return shlex.join(["python", *argv])


def _process_info() -> dict[str, Any]:
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "started": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": _command()}


def _read_info(fd: int) -> dict[str, Any]:
  """The holder a lock file names (`{}` if empty or unreadable)."""
  try:
    raw = os.pread(fd, 65536, 0)
    info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
  except (OSError, ValueError):
    return {}
  return info if isinstance(info, dict) else {}


def _describe(info: Mapping[str, Any]) -> str:
  return (f"PID {info.get('pid', '?')} on host {info.get('host', '?')}, "
          f"started {info.get('started', '?')} "
          f"({info.get('command', 'command unknown')})")


def _pid_runs(pid: Any) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ProcessLookupError, ValueError, TypeError):
    return False
  except PermissionError:
    return True
  return True


def _locked_error(path: str, info: Mapping[str, Any], *, remote: bool
                  ) -> RunDirLockedError:
  model_dir = os.path.dirname(path)
  if remote:
    return RunDirLockedError(
        f"model_dir={model_dir!r} is locked by a run on another host: "
        f"{_describe(info)}. Whether it still runs cannot be checked from "
        f"here: if it does not, delete {path} and run again; otherwise use "
        "another --model_dir.")
  holder = (_describe(info) if info else "one starting this moment (it "
            "has not written who it is yet)")
  return RunDirLockedError(
      f"model_dir={model_dir!r} is in use by a live run: {holder} "
      f"(lock {path}). Wait for it to end or stop it, or use another "
      "--model_dir.")


def _take(path: str) -> int:
  """Takes the lock file's `flock`; returns its fd (see `RunLock`)."""
  for _ in range(20):  # Retries only if the file is replaced meanwhile.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      info = _read_info(fd)
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise _locked_error(path, info, remote=False) from None
      raise
    try:
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False  # Its holder released and deleted it meanwhile.
    if not same:
      os.close(fd)
      continue
    try:
      _replace_stale(fd, path)
    except OSError:  # A full disk while writing who holds it: let it go.
      os.close(fd)
      raise
    return fd
  raise RunDirError(f"Could not take the lock {path}: it kept being replaced.")


def _replace_stale(fd: int, path: str) -> None:
  """Reports a stale holder, then writes this process into the lock file."""
  previous = _read_info(fd)
  if previous and previous.get("host") != socket.gethostname():
    os.close(fd)
    raise _locked_error(path, previous, remote=True)
  if previous:
    state = ("no longer runs" if not _pid_runs(previous.get("pid"))
             else "is another process now (the PID was reused)")
    logging.warning("Taking over the stale lock %s: its run (%s) ended "
                    "without releasing it; PID %s %s.", path,
                    _describe(previous), previous.get("pid"), state)
  data = json.dumps(_process_info(), indent=1).encode("utf-8") + b"\n"
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)
  os.fsync(fd)


class RunLock:
  """The lock of a run directory, held by one live run (see the module doc).

  Example:
    with RunLock("runs/a"):
      ...  # Train in runs/a; a second run on it refuses.

  Args:
    model_dir: the run directory (created if missing).
  """

  def __init__(self, model_dir: str):
    self.model_dir = model_dir
    self.path = os.path.join(model_dir, LOCK_NAME)
    self.held = False

  def acquire(self) -> "RunLock":
    """Takes the lock (reentrant within this process).

    Raises:
      RunDirLockedError: another live run holds it.
      RunDirError: the directory cannot be created.
    """
    if self.held:
      return self
    prepare_model_dir(self.model_dir)
    key = os.path.realpath(self.path)
    if key in _HELD:
      _HELD[key][1] += 1
    else:
      try:
        _HELD[key] = [_take(self.path), 1]
      except OSError as e:  # No write permission, no locks on this mount ...
        if files.is_disk_full(e):
          raise RunDirError(f"model_dir={self.model_dir!r} cannot be locked: "
                            f"{files.describe_os_error(e, self.path)}") from e
        raise RunDirError(
            f"model_dir={self.model_dir!r} cannot be locked: {self.path} "
            f"({e.strerror or e}). Use a directory on a writable local or "
            "shared filesystem that supports flock.") from e
    self.held = True
    return self

  def release(self) -> None:
    """Releases the lock; the last holder in the process deletes the file."""
    if not self.held:
      return
    self.held = False
    key = os.path.realpath(self.path)
    entry = _HELD[key]
    entry[1] -= 1
    if entry[1]:
      return
    del _HELD[key]
    if _is_file_of(entry[0], self.path):  # Not another run's, taken since.
      try:
        os.remove(self.path)  # Still under the flock: nobody takes it now.
      except FileNotFoundError:
        pass
    os.close(entry[0])

  def __enter__(self) -> "RunLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _is_file_of(fd: int, path: str) -> bool:
  """Whether `path` is the file open as `fd` (not deleted, not replaced)."""
  try:
    now, held = os.stat(path), os.fstat(fd)
  except FileNotFoundError:
    return False
  return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def keep_run_dir(model_dir: str) -> bool:
  """Puts back `run.lock` and `run.json` of the run this process holds in
  `model_dir` when they were deleted while it runs (the whole directory
  removed: saving a checkpoint recreates it without them, and a second run
  could take it). Warns, naming the directory, takes the lock anew and
  rewrites the record; nothing is stopped, so nothing more is lost.
  Called before each checkpoint save: a `stat` when all is well.

  Returns:
    Whether anything was put back (`False` too where this process holds no
    lock on `model_dir`: another task of a cluster, a lockless caller).

  Raises:
    RunDirLockedError: another run has taken the recreated directory since:
      this run's checkpoints must not go into that run's.
  """
  path = os.path.join(model_dir, LOCK_NAME)
  held = _HELD.get(os.path.realpath(path))
  if held is None or _is_file_of(held[0], path):
    return False
  try:
    prepare_model_dir(model_dir)
    fd = _take(path)
  except RunDirLockedError:
    raise _taken_since(model_dir, path) from None
  except (RunDirError, OSError) as e:  # No write permission, ...
    logging.warning("%s no longer holds this run's %s (deleted with the "
                    "directory?) and it cannot be put back: %s", model_dir,
                    LOCK_NAME, e)
    return False
  os.close(held[0])
  held[0] = fd
  lost = [LOCK_NAME]
  record = _RECORDS.get(os.path.realpath(model_dir))
  if record is not None and not os.path.exists(
      os.path.join(model_dir, RECORD_NAME)):
    write_record(model_dir, record)
    lost.append(RECORD_NAME)
  logging.warning("%s lost its %s while this run trains in it (deleted with "
                  "the directory?): put back, so that a second run on it "
                  "refuses again. What else it held before is gone "
                  "(checkpoints, summaries); the checkpoints from now on are "
                  "saved in it.", model_dir, " and ".join(lost))
  return True


def _taken_since(model_dir: str, path: str) -> RunDirLockedError:
  """The error for a run whose deleted `model_dir` another run now holds."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    info = {}
  else:
    info = _read_info(fd)
    os.close(fd)
  holder = _describe(info) if info else "one that has not written who it is"
  return RunDirLockedError(
      f"model_dir={model_dir!r} was deleted while this run trained in it, "
      f"and another run has taken it since: {holder} (lock {path}). This "
      "run's checkpoint is not saved there (it would go among that run's "
      "checkpoints) and this run stops; its earlier checkpoints went with "
      "the directory. Train again with another --model_dir.")


# -------------------------------------------------------------- record


def versions() -> dict[str, str]:
  """The installed versions of tfmgpu, TensorFlow and Keras (no import)."""
  found = {}
  for name in ("tfmgpu", "tensorflow", "keras"):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = "not installed"
  return found


# Settings that may name the user's files: recorded as absolute paths.
_PATHS = ("model", "dataset", "loss", "metrics", "data_path")


def _resolved(record: dict[str, Any]) -> dict[str, Any]:
  """`record` with the user's files named absolutely (relative ones, as an
  older tfmgpu recorded them, from the current directory, as it read them),
  so that `predict` finds them from any directory."""
  def resolve(value: Any) -> Any:
    if isinstance(value, list):
      return [resolve(v) for v in value]
    return user_code.resolvable(value)
  resolved = {k: resolve(v) if k in _PATHS else v for k, v in record.items()}
  path = resolved.get("data_path")
  if isinstance(path, str) and "://" not in path:  # Not gs://, s3://, ...
    resolved["data_path"] = os.path.abspath(path)
  return resolved


@dataclasses.dataclass(frozen=True)
class RecordedRun:
  """What `run.json` records of a run (`record_of`): the settings its
  checkpoints depend on (`FIXED`) and those a resume may change
  (`CHANGEABLE`). `TrainConfig.recorded_run` makes one.

  Attributes:
    placement: the distribution's word for what shapes the checkpoints
      (`Distribution.record`), e.g. `"pipeline (num_stages=3, ...)"`.
    micro_batches: a pipeline's micro-batches, else `None`.
    portable: whether its checkpoints restore into other layouts
      (`Distribution.portable`): a resume may then change the placement.
  """
  strategy: str
  placement: str
  micro_batches: int | None
  model: str
  model_size: str | None
  optimizer: str
  global_batch_size: int
  seed: int
  dataset: str | None
  learning_rate: float
  epochs: int
  steps_per_epoch: int | None
  loss: str | None = None
  metrics: tuple[str, ...] | None = None
  data_path: str | None = None
  portable: bool = False


def record_of(run: RecordedRun) -> dict[str, Any]:
  """What `run.json` holds for `run` (the user's files named absolutely,
  the versions of tfmgpu, TensorFlow and Keras added)."""
  return _resolved({
      "model": run.model, "model_size": run.model_size,
      "optimizer": run.optimizer,
      "global_batch_size": run.global_batch_size, "seed": run.seed,
      "dataset": run.dataset, "placement": run.placement,
      "micro_batches": run.micro_batches, "portable": run.portable,
      "learning_rate": run.learning_rate, "epochs": run.epochs,
      "steps_per_epoch": run.steps_per_epoch, "loss": run.loss,
      "metrics": (list(run.metrics) if run.metrics is not None
                  else None),  # As JSON reads it back.
      "strategy": run.strategy, "data_path": run.data_path,
      "versions": versions(),
  })


def read_record(model_dir: str) -> dict[str, Any] | None:
  """The record in `model_dir` (`None` if it has none, or an empty file).

  Raises:
    RunDirError: `run.json` exists but does not read as a record.
  """
  path = os.path.join(model_dir, RECORD_NAME)
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    text, record = None, e
  if text is not None:
    if not text.strip():
      return None  # Emptied (a kill while writing it): no record.
    try:
      record = json.loads(text)
    except ValueError as e:
      record = e
  if not isinstance(record, dict):
    raise RunDirError(
        f"{path} is not a readable run record ({record}). Fix it, or delete "
        "it to record this run's settings anew (the checkpoints are kept).")
  return _resolved(record)


def write_record(model_dir: str, record: Mapping[str, Any]) -> str:
  """Writes `run.json` whole or not at all; returns its path."""
  text = json.dumps(dict(record), indent=2, sort_keys=True) + "\n"
  path = files.write_atomically(os.path.join(model_dir, RECORD_NAME),
                                lambda f: f.write(text.encode("utf-8")))
  _RECORDS[os.path.realpath(model_dir)] = dict(record)
  return path


def _mismatch(model_dir: str, old: Mapping[str, Any],
              record: Mapping[str, Any], fields: list[str]) -> str:
  lines = [f"model_dir={model_dir!r} holds a run whose checkpoints depend on "
           "settings this run changes:"]
  for name in fields:
    flag = _FLAG_OF.get(name, name)
    lines.append(f"  {name}: {old[name]!r} -> {record.get(name)!r} "
                 f"(--{flag})")
  lines.append("Run again with the old values to resume it, or use a new "
               "--model_dir to start another run.")
  return "\n".join(lines)


def check_record(model_dir: str, record: Mapping[str, Any], *,
                 write: bool = True) -> list[str]:
  """Compares `record` with the directory's; writes or updates `run.json`.

  When the directory holds checkpoints but no record (`run.json` deleted or
  an empty file), what they depend on is unknown: the record is written
  only once a checkpoint has restored (`confirm_record`), so a run whose
  model or layout cannot read them leaves no record naming it.

  Args:
    model_dir: the run directory.
    record: this run's (`record_of(config.recorded_run)`).
    write: write the record (the chief); `False` only compares.

  Returns:
    The `CHANGEABLE` fields this run changes (applied, and logged), and
    the `MOVABLE` ones of a move between portable layouts.

  Raises:
    RunRecordMismatchError: a `FIXED` field differs while the directory
      holds checkpoints.
    RunDirError: `run.json` does not read, or names none of the settings
      the checkpoints depend on (e.g. `{}`).
  """
  old = read_record(model_dir)
  now = datetime.datetime.now().isoformat(timespec="seconds")
  if not has_checkpoints(model_dir):
    if write:
      write_record(model_dir, {**record, "created": now})
    return []
  if old is None:
    _await_restore(model_dir, {**record, "created": now}, write)
    return []
  if not any(f in old for f in FIXED):
    raise RunDirError(_blank_record(model_dir, old))
  fixed = [f for f in FIXED if f in old and old[f] != record.get(f)]
  if _moves_layout(model_dir, old, record, fixed):
    fixed = [f for f in fixed if f not in MOVABLE]
  if fixed:
    raise RunRecordMismatchError(_mismatch(model_dir, old, record, fixed))
  changed = [f for f in CHANGEABLE + MOVABLE if old.get(f) != record.get(f)]
  for name in changed:
    logging.info("Resuming %s with %s=%r (was %r): applied from now on.",
                 model_dir, name, record.get(name), old.get(name))
  if old.get("versions") != record.get("versions"):
    logging.info("Resuming %s with versions %s (it was written by %s).",
                 model_dir, record.get("versions"), old.get("versions"))
  if write:
    _RECORDS[os.path.realpath(model_dir)] = dict(old)
  if write and (changed or old.get("versions") != record.get("versions")):
    # Written once a checkpoint restores (`confirm_record`): a resume that
    # fails before then leaves the record naming what its checkpoints had.
    _UPDATES[os.path.realpath(model_dir)] = {**old, **record, "updated": now}
  return changed


def _moves_layout(model_dir: str, old: Mapping[str, Any],
                  record: Mapping[str, Any], fixed: list[str]) -> bool:
  """Whether a resume changes the placement (and at most its
  micro-batches: `MOVABLE`) between layouts whose checkpoints are both
  portable (a ZeRO run resumed as a pipeline): the weights restore by layer
  name, the optimizer's slots in the model's variable order (a layout that
  splits variables fails to read them, loudly, and names the checkpoint)."""
  if "placement" not in fixed or not set(fixed) <= set(MOVABLE):
    return False
  if not (old.get("portable") and record.get("portable")):
    return False
  logging.info("Resuming %s in another layout: %s (was %s); its checkpoints "
               "restore by layer name.", model_dir, record.get("placement"),
               old.get("placement"))
  return True


def _blank_record(model_dir: str, old: Mapping[str, Any]) -> str:
  path = os.path.join(model_dir, RECORD_NAME)
  return (f"{path} is {json.dumps(old)[:80]}: it names none of the settings "
          f"({', '.join(FIXED)}) that the checkpoints in "
          f"{os.path.join(model_dir, 'checkpoints')} depend on, so this run "
          "cannot be checked against them. Delete it to resume: the newest "
          "checkpoint must then restore into this run's model before a new "
          "record is written; or use a new --model_dir to start another run.")


def _await_restore(model_dir: str, record: dict[str, Any],
                   write: bool) -> None:
  """No record beside checkpoints: write one only after a restore."""
  logging.warning(
      "%s has checkpoints but no %s: the settings they were trained with are "
      "unknown. This run's model and layout are checked by restoring the "
      "newest checkpoint, and %s is written only after it restores; its "
      "seed, dataset and batch size cannot be checked.", model_dir,
      RECORD_NAME, RECORD_NAME)
  if write:
    _UNCONFIRMED[os.path.realpath(model_dir)] = record


def confirm_record(model_dir: str) -> str | None:
  """Writes the record that waited for a checkpoint to restore (see
  `check_record`: a missing one, or a resume's update); returns its path,
  or `None` if none waited."""
  key = os.path.realpath(model_dir)
  missing, update = _UNCONFIRMED.pop(key, None), _UPDATES.pop(key, None)
  record = missing if missing is not None else update
  return write_record(model_dir, record) if record is not None else None


def unconfirmed_error(model_dir: str, error: Exception) -> Exception:
  """`error` (no checkpoint restored) explained when `model_dir` has no
  record: the run's settings, not the checkpoints, may be what is wrong.
  Forgets the waiting record (or update): it is never written."""
  _UPDATES.pop(os.path.realpath(model_dir), None)
  record = _UNCONFIRMED.pop(os.path.realpath(model_dir), None)
  if record is None:
    return error
  settings = ", ".join(f"{f}={record.get(f)!r}" for f in FIXED
                       if record.get(f) is not None)
  reasons = "; ".join(getattr(error, "reasons", ())) or str(error)
  return RunDirError(
      f"model_dir={model_dir!r} has no {RECORD_NAME}, and its checkpoints do "
      f"not restore into this run ({settings}): {reasons}. They are most "
      "likely of another model or layout: run again with the --model, "
      "--model_size and --strategy (and its stage options) they were "
      f"trained with ({RECORD_NAME} is written once one restores), or use a "
      "new --model_dir to start another run.")


def check_outputs(model_dir: str) -> None:
  """Refuses, before anything trains, a `model_dir` where the run could not
  write its outputs or would replace a file of the user's.

  Raises:
    RunDirError: `model_dir/checkpoints` is not a directory (found only
      at the first save, after an epoch had trained); or the directory
      holds a `model.keras` but no run record or checkpoints: a file no
      run wrote, which the run's own would silently replace.
  """
  checkpoints = os.path.join(model_dir, "checkpoints")
  if os.path.exists(checkpoints) and not os.path.isdir(checkpoints):
    raise RunDirError(
        f"{checkpoints} is a file, not a directory: the run keeps its "
        "checkpoints there. Move the file, or give another --model_dir.")
  model = os.path.join(model_dir, "model.keras")
  if (os.path.exists(model) and read_record(model_dir) is None
      and not has_checkpoints(model_dir)):
    raise RunDirError(
        f"model_dir={model_dir!r} holds a model.keras that no run wrote "
        f"(there is no {RECORD_NAME} or checkpoint beside it): this run "
        "would replace it with its own. Give a new --model_dir, or move "
        "that file first.")


def open_run(model_dir: str, record: Mapping[str, Any], *,
             chief: bool = True) -> RunLock:
  """Prepares `model_dir` for a run: lock (chief), then record.

  Args:
    model_dir: the run directory.
    record: this run's (`record_of(config.recorded_run)`).
    chief: this process writes the run's outputs: it creates the directory,
      takes the lock, deletes temporary files that a killed run left
      (`files.remove_stale_temporaries`) and writes the record. Other
      workers only compare.

  Returns:
    The `RunLock` (held by the chief): release it when the run ends.

  Raises:
    RunDirError: the directory cannot be used, another run holds it, or
      the record forbids this resume.
  """
  lock = RunLock(model_dir)
  if chief:
    check_outputs(model_dir)
    lock.acquire()
    files.remove_stale_temporaries(model_dir)  # Of a run killed at a rename.
  try:
    check_record(model_dir, record, write=chief)
  except BaseException:
    lock.release()
    raise
  return lock
