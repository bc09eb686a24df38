"""`tfmgpu.files`: outputs written whole or not at all; OS errors said plainly."""

import errno
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from tfmgpu import files

TIMEOUT_S = 60


@pytest.fixture
def umask_027():
  old = os.umask(0o027)
  yield
  os.umask(old)


def _listing(directory):
  return sorted(os.listdir(directory))


def test_the_file_gets_the_mode_of_a_plain_open(tmp_path, umask_027):
  path = files.write_atomically(str(tmp_path / "a.bin"),
                                lambda f: f.write(b"new"))
  assert open(path, "rb").read() == b"new"
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # Not mkstemp's 0600.
  assert _listing(tmp_path) == ["a.bin"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path):
  path = str(tmp_path / "a.bin")
  files.write_atomically(path, lambda f: f.write(b"old"))

  def disk_full(f):
    f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")

  with pytest.raises(OSError, match="No space left on device"):
    files.write_atomically(path, disk_full)
  assert open(path, "rb").read() == b"old"
  assert _listing(tmp_path) == ["a.bin"]


def test_a_kill_during_the_write_leaves_nothing(tmp_path):
  code = ("import os, signal, sys; from tfmgpu import files\n"
          "def write(f):\n"
          "  f.write(b'x' * 100000); f.flush()\n"
          "  os.kill(os.getpid(), signal.SIGKILL)\n"
          "files.write_atomically(sys.argv[1], write)\n")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.bin")],
                        timeout=TIMEOUT_S, check=False)
  assert proc.returncode == -signal.SIGKILL
  assert _listing(tmp_path) == []  # The file had no name yet.


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError("10000 requested and 4064 written"),  # numpy's short write.
])
def test_a_full_disk_says_disk_full_and_names_the_path(error):
  assert files.describe_os_error(error, "/data/p.npy").startswith(
      "disk full while writing /data/p.npy")
  assert files.describe_os_error(error, "/data/p.npy").endswith(
      ": free space on that filesystem (or write elsewhere) and run the "
      "same command again.")


@pytest.mark.parametrize("error,said", [
    (OSError(errno.EFBIG, "File too large"),
     "file-size limit reached while writing /data/p.npy (File too large): "
     "raise the limit (ulimit -f shows it) or write to another filesystem, "
     "and run the same command again."),
    (OSError(errno.EDQUOT, "Disk quota exceeded"),
     "disk quota exceeded while writing /data/p.npy (Disk quota exceeded): "
     "free space within your quota (or write elsewhere) and run the same "
     "command again."),
])
def test_a_file_size_limit_or_a_quota_says_which(error, said):
  """`ulimit -f`: a raw 'File too large' traceback from a checkpoint write
  (TF's errors carry the words only, no errno)."""
  assert files.describe_os_error(error, "/data/p.npy") == said
  for words, code in (("ckpt-1_temp/part-0; File too large", errno.EFBIG),
                      ("x.tempstate1; Disk quota exceeded", errno.EDQUOT),
                      ("y; No space left on device", errno.ENOSPC),
                      ("Permission denied", None)):
    assert files.no_room(RuntimeError(words)) == code  # TF's OpError.


def test_other_os_errors_name_the_path_and_reason():
  error = PermissionError(errno.EACCES, "Permission denied", "/x/y")
  assert files.describe_os_error(error) == (
      "cannot write /x/y (Permission denied): check the path and its "
      "permissions.")


def test_predictions_follow_the_umask_and_replace_whole(tmp_path, umask_027):
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "p.npy")
  inference.save_predictions(path, np.ones((3, 2), np.float32))
  inference.save_predictions(path, np.zeros((4, 2), np.float32))
  np.testing.assert_array_equal(np.load(path), np.zeros((4, 2)))
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
  assert _listing(tmp_path) == ["p.npy"]


@pytest.mark.parametrize("outputs, names", [
    ({"cls": np.ones((3, 2)), "val": np.zeros((3, 1))}, ["cls", "val"]),
    ([np.ones((3, 2)), np.zeros((3, 1))], ["output_0", "output_1"]),
])
def test_several_outputs_are_written_as_one_npz(tmp_path, outputs, names):
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  written = inference.save_predictions(str(tmp_path / "p.npy"), outputs)
  assert written == str(tmp_path / "p.npz")
  assert _listing(tmp_path) == ["p.npz"]
  with np.load(written) as saved:  # No pickle needed.
    assert sorted(saved.files) == names
    for name, want in zip(names, _arrays_of(outputs)):
      np.testing.assert_array_equal(saved[name], want)


def _arrays_of(outputs):
  return list(outputs.values()) if isinstance(outputs, dict) else outputs


def test_by_name_replaces_whole_and_follows_the_umask(tmp_path, umask_027):
  path = str(tmp_path / "m.keras")
  seen = []

  def write(name):
    seen.append(name)
    with open(name, "wb") as f:
      f.write(b"new")

  assert files.write_atomically_by_name(path, write, suffix=".keras") == path
  assert seen[0].endswith(".keras") and os.path.dirname(seen[0]) == str(
      tmp_path)
  assert open(path, "rb").read() == b"new"
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
  assert _listing(tmp_path) == ["m.keras"]


def test_by_name_a_failed_write_keeps_the_previous_file(tmp_path):
  path = str(tmp_path / "m.keras")
  files.write_atomically_by_name(path, lambda n: open(n, "wb").write(b"old"))

  def disk_full(name):
    with open(name, "wb") as f:
      f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")

  with pytest.raises(OSError, match="No space left on device"):
    files.write_atomically_by_name(path, disk_full)
  assert open(path, "rb").read() == b"old"
  assert _listing(tmp_path) == ["m.keras"]


def _dead_pid() -> int:
  child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True)
  return int(child.stdout)


def test_whole_files_left_by_a_kill_before_the_rename_are_cleaned(tmp_path):
  """Issue 29 item 5: a SIGKILL between naming the complete temporary file
  and the rename left it forever; the next write in the directory (or a
  run opening its run directory) deletes those whose writer is gone."""
  dead, hexa = _dead_pid(), "0123456789abcdef" * 2
  old = time.time() - 7200
  left = {f".tmp-{dead}-{hexa}": None,  # A predictions file, this version.
          f".tmp-{hexa}": old,  # An older version's name (no PID).
          f".model.keras.tmp-{dead}.keras": None,  # A model saved aside.
          # This PID runs, but started after the file: a reused PID.
          f".tmp-{os.getpid()}-{hexa[::-1]}": old}
  kept = {f".tmp-{os.getpid()}-{hexa}": None,  # A live writer's.
          ".tmp-notours": None, "notes.txt": None}
  for name, mtime in {**left, **kept}.items():
    (tmp_path / name).write_bytes(b"whole")
    if mtime:
      os.utime(tmp_path / name, (mtime, mtime))
  files.write_atomically(str(tmp_path / "p.npy"), lambda f: f.write(b"x"))
  remaining = set(os.listdir(tmp_path))
  assert remaining >= set(kept) | {"p.npy"}
  assert not remaining & set(left)


def test_a_directory_output_is_written_whole_and_never_mixes_with_yours(
    tmp_path):
  """A SavedModel export wrote straight into the folder it was given: a
  user's notes.txt ended up beside saved_model.pb, a file there raised
  TF's raw FailedPreconditionError (a new user's trial)."""
  def write(content):
    def fill(name):
      os.makedirs(name)
      (pathlib.Path(name) / "saved_model.pb").write_text(content)
    return fill
  out = tmp_path / "sm"
  files.write_directory_atomically(str(out), write("one"),
                                   marker="saved_model.pb")
  files.write_directory_atomically(str(out), write("two"),
                                   marker="saved_model.pb")  # Replaced.
  assert (out / "saved_model.pb").read_text() == "two"

  def fails(name):
    write("three")(name)
    raise OSError("disk full")
  with pytest.raises(OSError, match="disk full"):
    files.write_directory_atomically(str(out), fails, marker="saved_model.pb")
  assert (out / "saved_model.pb").read_text() == "two"  # Untouched.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["sm"]  # No leftover.
  yours = tmp_path / "yours"
  yours.mkdir()
  (yours / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"holds files that are not this kind "
                     r"of output \(no saved_model.pb\)"):
    files.write_directory_atomically(str(yours), write("x"),
                                     marker="saved_model.pb")
  assert sorted(p.name for p in yours.iterdir()) == ["notes.txt"]
  (tmp_path / "a_file").write_text("mine")
  with pytest.raises(ValueError, match=r"is a file; this writes a directory"):
    files.write_directory_atomically(str(tmp_path / "a_file"), write("x"),
                                     marker="saved_model.pb")
  empty = tmp_path / "empty"
  empty.mkdir()  # An empty directory is taken.
  files.write_directory_atomically(str(empty), write("e"),
                                   marker="saved_model.pb")
  assert (empty / "saved_model.pb").read_text() == "e"


def test_a_killed_directory_write_leaves_nothing_behind(tmp_path):
  """A SIGKILL mid-export left its hidden directory; one between its two
  renames left the previous export moved aside and none in its place.
  The next write of that path sweeps the first and restores the second."""
  gone = subprocess.Popen(["true"])
  gone.wait()  # A writer that no longer runs.
  def write(name):
    os.makedirs(name)
    (pathlib.Path(name) / "saved_model.pb").write_text("new")
  host = files.host_name()
  for kind, content in (("tmp", "half"), ("old", "previous")):
    left = tmp_path / f".sm.{kind}-{gone.pid}-{host}-{uuid.uuid4().hex}"
    left.mkdir()
    (left / "saved_model.pb").write_text(content)
  # A writer still at work: left alone, though the export it moved aside
  # keeps the mtime of long ago (its ctime is the rename's).
  running = tmp_path / f".sm.old-{os.getpid()}-{host}-{uuid.uuid4().hex}"
  running.mkdir()
  os.utime(running, (1e9, 1e9))
  other = tmp_path / f".other.tmp-{gone.pid}-{host}-{uuid.uuid4().hex}"
  other.mkdir()  # Another path's: swept by its own next write.
  elsewhere = tmp_path / f".sm.tmp-{gone.pid}-otherhost-{uuid.uuid4().hex}"
  elsewhere.mkdir()  # Another host's (a shared volume): not ours to judge.
  files._sweep_killed_directory_writes(str(tmp_path), "sm")
  assert (tmp_path / "sm" / "saved_model.pb").read_text() == "previous"
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      ["sm", running.name, other.name, elsewhere.name])
  files.write_directory_atomically(str(tmp_path / "sm"), write,
                                   marker="saved_model.pb")
  assert (tmp_path / "sm" / "saved_model.pb").read_text() == "new"
