"""Output files written whole or not at all, and OS errors said plainly.

`write_atomically` writes a file aside and renames it into place: a kill or
a full disk leaves the previous file (or none), never a torn one, and no
temporary file behind. On Linux the aside file is anonymous (`O_TMPFILE`):
it has no name until it is complete, so even SIGKILL leaves nothing. The new
file gets the mode a plain `open(path, "w")` would give (0666 less the
umask), not the 0600 of `tempfile.mkstemp`. `write_atomically_by_name` does
the same for a writer that needs a file name (Keras' `model.save`). A
SIGKILL between naming the complete file and the rename leaves it whole
under a hidden name with the writer's PID; `remove_stale_temporaries`
(called by the next write in the directory, and for a run directory when a
run opens it) deletes those whose writer is gone.
`write_directory_atomically` does it for a directory (a SavedModel); its
next write of the same path sweeps what a killed one left.

`describe_os_error` turns an `OSError` into one sentence naming the path
and what to do; a full disk says "disk full", a quota or a file-size limit
(`ulimit -f`) says which (`no_room`).

Importing this module imports nothing heavy.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import uuid
from typing import Any, BinaryIO, Callable

from absl import logging

# The limits a write runs into ("no room"): errno -> (what it is, what to
# do). TF's errors carry only the text (strerror), matched in `_NO_ROOM_TEXT`.
_NO_ROOM = {
    errno.ENOSPC: ("disk full", "free space on that filesystem (or write "
                   "elsewhere)"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota (or "
                   "write elsewhere)"),
    errno.EFBIG: ("file-size limit reached", "raise the limit (ulimit -f "
                  "shows it) or write to another filesystem,"),
}
_NO_ROOM_TEXT = {"No space left on device": errno.ENOSPC,
                 "Disk quota exceeded": errno.EDQUOT,
                 "File too large": errno.EFBIG}


def fsync_path(path: str) -> None:
  """fsyncs a file, or a directory (its entries: a rename or a new file)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


fsync_directory = fsync_path


def no_room(error: BaseException) -> int | None:
  """The limit `error` ran into, as an errno: `ENOSPC` (the disk is full),
  `EDQUOT` (the quota), `EFBIG` (a file-size limit: `ulimit -f`); `None`
  for other errors. By errno, or by its words (TF's errors carry no
  errno). A short write without an errno (numpy's "10000 requested and
  4064 written") is `ENOSPC`: on a regular file it means the same.
  """
  if isinstance(error, OSError) and error.errno in _NO_ROOM:
    return error.errno
  text = str(error)
  if "requested and" in text and "written" in text:
    return errno.ENOSPC
  return next((code for words, code in _NO_ROOM_TEXT.items()
               if words in text), None)


def is_disk_full(error: BaseException) -> bool:
  """Whether `error` means there is no room to write: the disk or the quota
  is full, or a file-size limit is reached (`no_room`)."""
  return no_room(error) is not None


def describe_os_error(error: OSError, path: str | None = None) -> str:
  """One sentence for an `OSError` while writing `path`.

  Args:
    error: the error.
    path: the file or directory being written; defaults to the error's own
      `filename`.
  """
  path = path or error.filename or "?"
  limit = no_room(error)
  if limit is not None:
    what, fix = _NO_ROOM[limit]
    why = f" ({error.strerror})" if error.strerror else ""
    return (f"{what} while writing {path}{why}: {fix} and run the same "
            "command again.")
  why = error.strerror or str(error) or type(error).__name__
  return f"cannot write {path} ({why}): check the path and its permissions."


# Temporary files of a writer: `.tmp-PID-HEX` (`write_atomically`; older
# versions wrote `.tmp-HEX`) and `.NAME.tmp-PID.keras` (a model saved aside).
_TEMPORARY = re.compile(
    r"^\.(?:tmp-(?:(?P<pid>\d+)-)?[0-9a-f]{32}|.+\.tmp-(?P<kpid>\d+)\.keras)$")


def _process_start(pid: int) -> float | None:
  """When process `pid` started (seconds since the epoch), `None` if it does
  not run (or this is not Linux)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
      boot = next(int(line.split()[1]) for line in f
                  if line.startswith("btime"))
  except (OSError, ValueError, IndexError, StopIteration):
    return None
  return boot + ticks / os.sysconf("SC_CLK_TCK")


def writer_is_gone(pid: int, mtime: float) -> bool:
  """Whether process `pid`, which wrote something last changed at `mtime`,
  is gone: it does not run, or runs but started after that (a reused PID).
  `False` where processes cannot be asked about (no `/proc`)."""
  if not os.path.isdir("/proc/self"):
    return False
  started = _process_start(pid)
  return started is None or mtime < started - 1.0


def _is_stale(name: str, mtime: float) -> bool:
  """A temporary file whose writer is gone (`writer_is_gone`). A name
  without a PID (an older tfmgpu's) is stale when it is older than this
  process."""
  match = _TEMPORARY.match(name)
  if not match:
    return False  # Not ours.
  pid = match.group("pid") or match.group("kpid")
  if pid is not None:
    return writer_is_gone(int(pid), mtime)
  started = _process_start(os.getpid())
  return started is not None and mtime < started - 1.0


def remove_stale_temporaries(directory: str) -> list[str]:
  """Deletes the whole-but-unnamed files that writers killed before their
  final rename left in `directory` (see `_is_stale`); logs and returns them.
  Never raises: cleaning is best effort."""
  removed = []
  try:
    names = os.listdir(directory)
  except OSError:
    return removed
  for name in names:
    path = os.path.join(directory, name)
    try:
      if _TEMPORARY.match(name) and _is_stale(name, os.stat(path).st_mtime):
        os.remove(path)
        removed.append(path)
    except OSError:
      continue
  if removed:
    logging.warning("Removed %d temporary file(s) that a killed run left "
                    "before its final rename: %s.", len(removed),
                    ", ".join(removed))
  return removed


def _temporary_name(directory: str) -> str:
  return os.path.join(directory, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")


def _open_aside(directory: str) -> tuple[int, str | None]:
  """An anonymous file in `directory` (Linux), else a named hidden one.

  Returns:
    `(fd, name)`: `name` is `None` for an anonymous file.
  """
  if hasattr(os, "O_TMPFILE"):
    try:
      return os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o666), None
    except OSError as e:
      if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
        raise  # A full disk, no permission, ...: the same for a named file.
  name = _temporary_name(directory)
  return os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), name


def _link_anonymous(fd: int, name: str) -> None:
  """Gives the `O_TMPFILE` file `fd` the path `name`.

  `linkat(AT_SYMLINK_FOLLOW)` of `/proc/self/fd/N`; Python calls plain
  `link()` (which would link the /proc symlink itself) unless a directory fd
  is given, hence `dst_dir_fd`.
  """
  directory = os.open(os.path.dirname(name), os.O_RDONLY)
  try:
    os.link(f"/proc/self/fd/{fd}", os.path.basename(name),
            dst_dir_fd=directory, follow_symlinks=True)
  finally:
    os.close(directory)


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> str:
  """Writes `path` whole or not at all; returns `path`.

  `write(f)` writes the contents to a binary file object; the file is then
  fsynced, renamed over `path`, and the directory fsynced.

  Raises:
    OSError: the write failed (the previous `path`, if any, is untouched and
      no temporary file is left).
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  remove_stale_temporaries(directory)
  fd, name = _open_aside(directory)
  try:
    with os.fdopen(fd, "wb", closefd=False) as f:
      write(f)
      f.flush()
      os.fsync(fd)
    if name is None:  # O_TMPFILE's mode 0666 took the umask, as open() does.
      name = _temporary_name(directory)
      _link_anonymous(fd, name)  # Named only when complete.
    os.replace(name, path)
    name = None
  finally:
    os.close(fd)
    if name is not None and os.path.exists(name):
      os.remove(name)
  fsync_directory(directory)
  return path


def write_atomically_by_name(path: str, write: Callable[[str], None],
                             suffix: str = "") -> str:
  """`write_atomically` for a writer that takes a file name; returns `path`.

  `write(name)` writes a hidden file beside `path` whose name ends in
  `suffix` (Keras' `model.save` wants `.keras`); the file is then fsynced,
  renamed over `path`, and the directory fsynced. It has a name from the
  start, so a SIGKILL during `write` can leave it behind; any exception
  removes it.

  Raises:
    OSError: the write failed (the previous `path`, if any, is untouched).
  """
  directory, base = os.path.split(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  name = os.path.join(directory, f".{base}.tmp-{uuid.uuid4().hex}{suffix}")
  try:
    write(name)
    fsync_path(name)
    os.replace(name, path)
  finally:
    if os.path.exists(name):
      os.remove(name)
  fsync_directory(directory)
  return path


def write_directory_atomically(path: str, write: Callable[[str], None], *,
                               marker: str) -> str:
  """Writes the directory `path` whole or not at all; returns `path`.

  `write(name)` fills a hidden directory beside `path`, which then takes
  its place (a previous one is moved aside, then deleted). A directory
  that holds files but no `marker` (say `saved_model.pb`) is someone
  else's: refused, never mixed into or replaced.

  Raises:
    ValueError: `path` is a file, or a directory of other files.
    OSError: the write failed (the previous `path`, if any, is untouched).
  """
  parent, base = os.path.split(os.path.abspath(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{path!r} is a file; this writes a directory there. "
                     "Give a new path.")
  if (os.path.isdir(path) and os.listdir(path)
      and not os.path.exists(os.path.join(path, marker))):
    raise ValueError(
        f"{path!r} holds files that are not this kind of output (no "
        f"{marker}): they would be mixed with it. Give a new or empty "
        "directory.")
  os.makedirs(parent, exist_ok=True)
  _sweep_killed_directory_writes(parent, base)
  tag = f"{os.getpid()}-{host_name()}-{uuid.uuid4().hex}"
  name, old = os.path.join(parent, f".{base}.tmp-{tag}"), None
  try:
    write(name)
    if os.path.isdir(path):
      old = os.path.join(parent, f".{base}.old-{tag}")
      os.replace(path, old)
    os.replace(name, path)
  finally:
    for leftover in (name, old):
      if leftover and os.path.isdir(leftover):
        shutil.rmtree(leftover, ignore_errors=True)
  fsync_directory(parent)
  return path


def host_name() -> str:
  """This host's name as a file name can hold it (no `-`, `/`)."""
  return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _sweep_killed_directory_writes(parent: str, base: str) -> None:
  """Deletes what a `write_directory_atomically` of `parent/base` killed
  mid-write left (its hidden `.BASE.tmp-PID-HOST-HEX` directory); a
  previous output it had moved aside (`.BASE.old-...`) goes back to `base`
  if the kill came before the new one took its place, else is deleted.

  Only this host's and this user's entries whose writer is gone count
  (`writer_is_gone`, against the entry's ctime: a rename keeps the mtime
  of what it moves). Best effort: never raises."""
  pattern = re.compile(
      rf"\.{re.escape(base)}\.(tmp|old)-(\d+)-{re.escape(host_name())}-"
      r"[0-9a-f]{32}")
  target = os.path.join(parent, base)
  try:
    entries = list(os.scandir(parent))
  except OSError:
    return
  for entry in entries:
    match = pattern.fullmatch(entry.name)
    try:
      info = entry.stat(follow_symlinks=False)
      if not (match and stat.S_ISDIR(info.st_mode)
              and info.st_uid == os.getuid()
              and writer_is_gone(int(match.group(2)), info.st_ctime)):
        continue
      if match.group(1) == "old" and not os.path.exists(target):
        os.replace(entry.path, target)
        logging.warning("Restored %s, which a killed write had moved "
                        "aside.", target)
      else:
        shutil.rmtree(entry.path)
        logging.warning("Removed %s, left by a killed write of %s.",
                        entry.path, target)
    except OSError:
      continue


def save_keras_model(model: Any, path: str) -> str:
  """`model.save(path)` (a `.keras` file) written aside and renamed into
  place (`write_atomically_by_name`): a kill or a full disk leaves the
  previous `path` whole, never a torn one. Returns `path`.

  Raises:
    OSError: the save failed, naming `path`.
  """
  try:
    return write_atomically_by_name(path, model.save, suffix=".keras")
  except OSError as e:
    if e.filename is None:  # Keras' zip writer names no file: name it.
      raise OSError(e.errno, e.strerror or str(e), path) from e
    raise
