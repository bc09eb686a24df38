"""`tfmgpu.rundir`: one live run per directory (lock) and its record.

TensorFlow-free: a second "run" is a tiny Python process that takes the lock
(`_HOLDER`), so the tests are fast.
"""

import json
import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys

import pytest

from tfmgpu import rundir
from tfmgpu.config import TrainConfig

TIMEOUT_S = 60

# Takes the lock of argv[1], says so, then waits for a line on stdin (or, with
# argv[2] == "die", dies by SIGKILL while holding it).
_HOLDER = r"""
import os, signal, sys
from tfmgpu import rundir
lock = rundir.RunLock(sys.argv[1]).acquire()
print("held", os.getpid(), flush=True)
if sys.argv[2] == "die":
  os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""


@pytest.fixture
def holder(tmp_path):
  """Starts a process holding `tmp_path/run`'s lock; yields (proc, pid)."""
  procs = []

  def start(mode="hold"):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "run"), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    with selectors.DefaultSelector() as selector:
      selector.register(proc.stdout, selectors.EVENT_READ)
      assert selector.select(TIMEOUT_S), "the lock holder said nothing"
    line = proc.stdout.readline()
    assert line.startswith("held "), line
    return proc, int(line.split()[1])

  yield start
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=TIMEOUT_S)


# ---------------------------------------------------------------- lock


def test_a_second_run_refuses_naming_the_live_one(tmp_path, holder):
  proc, pid = holder()
  lock_file = tmp_path / "run" / rundir.LOCK_NAME
  info = json.loads(lock_file.read_text())
  assert info["pid"] == pid and info["host"] == socket.gethostname()
  assert info["started"] and "-c" in info["command"]

  with pytest.raises(rundir.RunDirLockedError, match=(
      rf"model_dir='{re.escape(str(tmp_path / 'run'))}' is in use by a live "
      rf"run: PID {pid} on host {re.escape(socket.gethostname())}, started "
      r"\S+ \(.+\) \(lock .+run\.lock\)\. Wait for it to end or stop it, or "
      r"use another --model_dir\.")):
    rundir.RunLock(str(tmp_path / "run")).acquire()

  proc.communicate("go\n", timeout=TIMEOUT_S)
  assert proc.returncode == 0
  assert not lock_file.exists()  # Released and removed on exit.
  with rundir.RunLock(str(tmp_path / "run")) as lock:
    assert lock.held
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
  assert not lock_file.exists()


def test_a_stale_lock_of_a_dead_run_is_reported_and_taken_over(
    tmp_path, holder, caplog):
  proc, pid = holder("die")
  assert proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
  lock_file = tmp_path / "run" / rundir.LOCK_NAME
  assert json.loads(lock_file.read_text())["pid"] == pid  # Left behind.

  with rundir.RunLock(str(tmp_path / "run")):
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
  assert re.search(rf"Taking over the stale lock .*run\.lock: its run \(PID "
                   rf"{pid} on host .*\) ended without releasing it; PID {pid} "
                   r"no longer runs\.", caplog.text), caplog.text


def test_a_lock_file_of_another_host_is_not_taken_over(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  (run / rundir.LOCK_NAME).write_text(json.dumps(
      {"host": "elsewhere", "pid": 7, "started": "2026-01-01T00:00:00",
       "command": "python -m tfmgpu.train"}))
  with pytest.raises(rundir.RunDirLockedError, match=(
      r"is locked by a run on another host: PID 7 on host elsewhere, "
      r"started 2026-01-01T00:00:00 \(python -m tfmgpu\.train\)\. Whether it "
      r"still runs cannot be checked from here: if it does not, delete "
      rf"{re.escape(str(run / rundir.LOCK_NAME))} and run again")):
    rundir.RunLock(str(run)).acquire()


def test_a_lock_taken_but_not_yet_written_says_a_run_is_starting(tmp_path):
  """Two runs starting at once: the loser read the winner's lock before
  it was written, and said `PID ? on host ?, started ? (command unknown)`."""
  import fcntl  # pylint: disable=g-import-not-at-top
  path = tmp_path / rundir.LOCK_NAME
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # Taken, still empty.
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(rundir.RunDirLockedError, match=(
        r"is in use by a live run: one starting this moment \(it has not "
        r"written who it is yet\)")):
      rundir._take(str(path))  # pylint: disable=protected-access
  finally:
    os.close(fd)


def test_the_lock_is_reentrant_within_a_process(tmp_path):
  outer = rundir.RunLock(str(tmp_path)).acquire()
  with rundir.RunLock(str(tmp_path)):  # What Trainer.fit does under the CLI.
    pass
  assert (tmp_path / rundir.LOCK_NAME).exists()  # The outer still holds it.
  outer.release()
  assert not (tmp_path / rundir.LOCK_NAME).exists()


@pytest.mark.parametrize("how", ["file", "under a file"])
def test_a_model_dir_that_cannot_be_a_directory_is_named(tmp_path, how):
  (tmp_path / "f").write_text("x")
  path = str(tmp_path / "f") if how == "file" else str(tmp_path / "f" / "run")
  match = (r"is a regular file, not a directory\. Give a directory"
           if how == "file" else r"cannot be created \(Not a directory\)\. "
           r"Choose a path in a writable directory\.")
  with pytest.raises(rundir.RunDirError,
                     match=rf"model_dir={re.escape(repr(path))} {match}"):
    rundir.RunLock(path).acquire()


# -------------------------------------------------------------- record


def _record(**changes):
  config = TrainConfig(strategy="one_device", model="mlp", epochs=2,
                       steps_per_epoch=5).replace(**changes)
  return rundir.record_of(config.recorded_run)


def _with_checkpoint(model_dir):
  os.makedirs(model_dir / "checkpoints", exist_ok=True)
  (model_dir / "checkpoints" / "ckpt-1.index").write_bytes(b"")


def test_the_record_holds_the_run(tmp_path):
  record = _record()
  assert {k: record[k] for k in rundir.FIXED} == {
      "model": "mlp", "model_size": None, "optimizer": "adam",
      "global_batch_size": 64, "seed": 0, "dataset": "digits",
      "placement": "data_parallel", "micro_batches": None}
  assert (record["learning_rate"], record["epochs"]) == (2e-3, 2)
  assert set(record["versions"]) == {"tfmgpu", "tensorflow", "keras"}
  assert rundir.record_of(TrainConfig(
      strategy="pipeline", num_stages=3).recorded_run)[
      "placement"] == "pipeline (num_stages=3, partition=balanced)"
  assert rundir.record_of(TrainConfig(  # Hybrid sizes shape checkpoints.
      strategy="pipeline", num_stages=2, data_parallel=2,
      tensor_parallel=2).recorded_run)[
          "placement"] == ("pipeline (num_stages=2, partition=balanced, "
                           "data_parallel=2, tensor_parallel=2)")
  lock = rundir.open_run(str(tmp_path), record)
  lock.release()
  saved = json.loads((tmp_path / rundir.RECORD_NAME).read_text())
  assert {k: saved[k] for k in record} == json.loads(json.dumps(record))
  assert "created" in saved


def test_a_resume_that_changes_what_checkpoints_depend_on_is_refused(
    tmp_path):
  rundir.open_run(str(tmp_path), _record()).release()
  _with_checkpoint(tmp_path)
  with pytest.raises(rundir.RunRecordMismatchError) as refused:
    rundir.open_run(str(tmp_path), _record(seed=1, model="convnet",
                                           global_batch_size=32))
  assert str(refused.value) == (
      f"model_dir={str(tmp_path)!r} holds a run whose checkpoints depend on "
      "settings this run changes:\n"
      "  model: 'mlp' -> 'convnet' (--model)\n"
      "  global_batch_size: 64 -> 32 (--global_batch_size)\n"
      "  seed: 0 -> 1 (--seed)\n"
      "Run again with the old values to resume it, or use a new "
      "--model_dir to start another run.")
  assert not (tmp_path / rundir.LOCK_NAME).exists()  # Released on refusal.
  with pytest.raises(rundir.RunRecordMismatchError,
                     match=r"placement: 'data_parallel' -> 'pipeline "
                     r"\(num_stages=2, partition=balanced\)' \(--strategy\)"):
    rundir.check_record(str(tmp_path), rundir.record_of(
        TrainConfig(strategy="pipeline", model="mlp", epochs=2,
                    steps_per_epoch=5).recorded_run))


def test_a_resume_applies_and_logs_what_may_change(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  rundir.open_run(str(tmp_path), _record()).release()
  _with_checkpoint(tmp_path)
  changed = rundir.check_record(str(tmp_path),
                                _record(learning_rate=1e-4, epochs=4))
  assert changed == ["learning_rate", "epochs"]
  assert "with learning_rate=0.0001 (was 0.002): applied from now on" in (
      caplog.text)
  # Written once a checkpoint restores into the run: a resume that fails
  # before then (its checkpoints do not restore, ...) leaves it as it was.
  saved = json.loads((tmp_path / rundir.RECORD_NAME).read_text())
  assert (saved["learning_rate"], saved["epochs"]) == (2e-3, 2)
  rundir.confirm_record(str(tmp_path))
  saved = json.loads((tmp_path / rundir.RECORD_NAME).read_text())
  assert (saved["learning_rate"], saved["epochs"]) == (1e-4, 4)
  assert "updated" in saved
  rundir.check_record(str(tmp_path), _record(epochs=6))
  error = ValueError("no checkpoint restores")
  assert rundir.unconfirmed_error(str(tmp_path), error) is error
  assert rundir.confirm_record(str(tmp_path)) is None  # Forgotten.
  assert json.loads((tmp_path / rundir.RECORD_NAME).read_text())[
      "epochs"] == 4
  # A directory without checkpoints holds no run yet: anything goes.
  os.remove(tmp_path / "checkpoints" / "ckpt-1.index")
  assert rundir.check_record(str(tmp_path), _record(seed=5)) == []
  assert json.loads((tmp_path / rundir.RECORD_NAME).read_text())["seed"] == 5


def test_other_workers_compare_but_never_write(tmp_path):
  assert rundir.check_record(str(tmp_path), _record(), write=False) == []
  assert not (tmp_path / rundir.RECORD_NAME).exists()
  rundir.open_run(str(tmp_path), _record()).release()
  _with_checkpoint(tmp_path)
  lock = rundir.open_run(str(tmp_path), _record(epochs=3), chief=False)
  assert not lock.held and not (tmp_path / rundir.LOCK_NAME).exists()
  assert json.loads((tmp_path / rundir.RECORD_NAME).read_text())[
      "epochs"] == 2
  with pytest.raises(rundir.RunRecordMismatchError, match="seed: 0 -> 2"):
    rundir.open_run(str(tmp_path), _record(seed=2), chief=False)


def test_a_change_of_micro_batches_is_refused(tmp_path):
  """Issue 29 item 3: micro-batches decide a pipeline's arithmetic."""
  def pipeline(micro_batches):
    return rundir.record_of(TrainConfig(
        strategy="pipeline", model="mlp",
        micro_batches=micro_batches).recorded_run)
  assert pipeline(4)["micro_batches"] == 4
  rundir.open_run(str(tmp_path), pipeline(4)).release()
  _with_checkpoint(tmp_path)
  with pytest.raises(rundir.RunRecordMismatchError,
                     match=r"micro_batches: 4 -> 2 \(--micro_batches\)"):
    rundir.open_run(str(tmp_path), pipeline(2))
  rundir.open_run(str(tmp_path), pipeline(4)).release()


def test_a_portable_run_may_resume_in_another_portable_layout(tmp_path):
  """A ZeRO run's checkpoints carry the weights by layer name: it resumes
  as a pipeline (placement and micro-batches change); plain mirrored's do
  not, and a move into it is refused."""
  def record(**settings):
    return rundir.record_of(TrainConfig(model="mlp", **settings).recorded_run)
  zero3 = record(strategy="mirrored", zero_stage=3)
  assert zero3["portable"] and not record(strategy="mirrored")["portable"]
  rundir.open_run(str(tmp_path), zero3).release()
  _with_checkpoint(tmp_path)
  pipe = record(strategy="pipeline", num_stages=2)
  assert pipe["portable"]
  assert rundir.check_record(str(tmp_path), pipe) == ["placement",
                                                      "micro_batches"]
  rundir.confirm_record(str(tmp_path))  # A checkpoint restored.
  saved = json.loads((tmp_path / rundir.RECORD_NAME).read_text())
  assert saved["placement"] == pipe["placement"]
  with pytest.raises(rundir.RunRecordMismatchError,
                     match=r"placement: 'pipeline .*' -> 'data_parallel'"):
    rundir.check_record(str(tmp_path), record(strategy="mirrored"))
  with pytest.raises(rundir.RunRecordMismatchError, match=r"seed: 0 -> 1"):
    rundir.check_record(str(tmp_path), record(strategy="mirrored",
                                              zero_stage=3, seed=1))


def test_a_model_dir_deleted_while_its_run_lives_gets_lock_and_record_back(
    tmp_path, caplog):
  """The whole model_dir deleted mid-run: the checkpoints recreated it
  without run.lock and run.json, silently, and a second run could take it
  (fault trial n)."""
  import fcntl  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  model_dir = tmp_path / "run"
  rundir.open_run(str(model_dir), _record()).release()
  _with_checkpoint(model_dir)
  recorded = (model_dir / rundir.RECORD_NAME).read_text()
  lock = rundir.open_run(str(model_dir), _record())  # A resume.
  assert not rundir.keep_run_dir(str(model_dir))  # All there: nothing.
  shutil.rmtree(model_dir)
  assert rundir.keep_run_dir(str(model_dir))
  assert f"{model_dir} lost its run.lock and run.json while this run " in (
      caplog.text)
  assert (model_dir / rundir.RECORD_NAME).read_text() == recorded
  info = json.loads((model_dir / rundir.LOCK_NAME).read_text())
  assert info["pid"] == os.getpid()
  fd = os.open(model_dir / rundir.LOCK_NAME, os.O_RDWR)
  try:  # Held again: a second run refuses.
    with pytest.raises(BlockingIOError):
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  finally:
    os.close(fd)
  assert not rundir.keep_run_dir(str(model_dir))  # Warned once.
  assert caplog.text.count("lost its") == 1
  lock.release()
  assert not (model_dir / rundir.LOCK_NAME).exists()
  assert not rundir.keep_run_dir(str(model_dir))  # Not held: nothing.


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_record_is_written_only_after_a_restore(tmp_path, caplog,
                                                          content):
  """No (or an empty) run.json beside checkpoints: nothing is written until
  `confirm_record` (a checkpoint restored); a failed restore forgets it."""
  _with_checkpoint(tmp_path)
  path = tmp_path / rundir.RECORD_NAME
  if content is not None:
    path.write_text(content)
  rundir.open_run(str(tmp_path), _record(model="convnet")).release()
  assert "checkpoints but no run.json" in caplog.text
  assert not path.exists() or path.read_text() == content
  error = rundir.unconfirmed_error(str(tmp_path), RuntimeError("unreadable"))
  assert isinstance(error, rundir.RunDirError)
  assert "do not restore into this run (model='convnet'" in str(error)
  assert rundir.confirm_record(str(tmp_path)) is None  # Forgotten.
  assert not path.exists() or path.read_text() == content
  rundir.open_run(str(tmp_path), _record()).release()
  assert rundir.confirm_record(str(tmp_path)) == str(path)
  assert json.loads(path.read_text())["model"] == "mlp"
  other = RuntimeError("x")
  assert rundir.unconfirmed_error(str(tmp_path), other) is other


def test_a_blank_record_beside_checkpoints_is_refused(tmp_path):
  _with_checkpoint(tmp_path)
  (tmp_path / rundir.RECORD_NAME).write_text("{}")
  with pytest.raises(rundir.RunDirError, match=(
      r"run.json is \{\}: it names none of the settings \(model, .*"
      r"Delete it to resume")):
    rundir.open_run(str(tmp_path), _record(seed=1))


def test_an_unreadable_record_is_named(tmp_path):
  (tmp_path / rundir.RECORD_NAME).write_text("{not json")
  with pytest.raises(rundir.RunDirError, match=(
      rf"{re.escape(str(tmp_path / rundir.RECORD_NAME))} is not a readable "
      r"run record \(.+\)\. Fix it, or delete it to record this run's "
      r"settings anew \(the checkpoints are kept\)\.")):
    rundir.open_run(str(tmp_path), _record())


def test_a_full_disk_at_lock_time_says_disk_full(tmp_path, monkeypatch):
  """Issue 29 item 5: it was reported as "no flock support"."""
  import errno  # pylint: disable=g-import-not-at-top

  def no_space(fd, data, offset):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(os, "pwrite", no_space)
  with pytest.raises(rundir.RunDirError) as full:
    rundir.RunLock(str(tmp_path)).acquire()
  assert str(full.value) == (
      f"model_dir={str(tmp_path)!r} cannot be locked: disk full while writing "
      f"{tmp_path / rundir.LOCK_NAME} (No space left on device): free space "
      "on that filesystem (or write elsewhere) and run the same command again.")
  monkeypatch.undo()
  rundir.RunLock(str(tmp_path)).acquire().release()  # Nothing held.


def test_opening_a_run_dir_removes_what_a_killed_save_left(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout
  left = tmp_path / f".model.keras.tmp-{int(dead)}.keras"
  left.write_bytes(b"a whole model")
  rundir.open_run(str(tmp_path), _record()).release()
  assert not left.exists()


def test_a_model_dir_whose_outputs_cannot_be_written_is_refused_first(
    tmp_path):
  """Found by a new user: a model.keras of their own in an ordinary folder
  was replaced by the run's, silently; a `checkpoints` file was found only
  at the first save, after an epoch had trained. Both are refused before
  the lock or record is written; a run's own model.keras is not."""
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "model.keras").write_bytes(b"my precious")
  with pytest.raises(rundir.RunDirError, match=r"holds a model.keras that no "
                     r"run wrote \(there is no run.json or checkpoint beside "
                     r"it\): this run would replace it"):
    rundir.open_run(str(mine), _record())
  assert sorted(os.listdir(mine)) == ["model.keras"]
  blocked = tmp_path / "blocked"
  blocked.mkdir()
  (blocked / "checkpoints").write_text("not a directory")
  with pytest.raises(rundir.RunDirError, match=r"checkpoints is a file, not a "
                     r"directory: the run keeps its checkpoints there"):
    rundir.open_run(str(blocked), _record())
  done = tmp_path / "done"
  rundir.open_run(str(done), _record()).release()
  (done / "model.keras").write_bytes(b"the run's own")
  rundir.open_run(str(done), _record()).release()  # Resumed, not refused.
