"""`Checkpointer`: checkpoint numbers, the saved position, restore, latest."""

import gc
import glob
import os
import re
import socket
import subprocess
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.training import checkpoints


def _model_and_optimizer(seed):
  """A tiny model and an SGD optimizer that has taken `seed` steps."""
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.set_weights([np.full((3, 2), seed, np.float32),
                     np.full((2,), -seed, np.float32)])
  optimizer = keras.optimizers.SGD(learning_rate=0.1)
  optimizer.build(model.trainable_variables)
  optimizer.iterations.assign(seed)
  return model, optimizer


def _checkpointer(model_dir, seed=0):
  model, optimizer = _model_and_optimizer(seed)
  return checkpoints.Checkpointer(str(model_dir), tf.distribute.get_strategy(),
                                  model=model, optimizer=optimizer)


def _saved_numbers(model_dir):
  return sorted(int(os.path.basename(p)[len("ckpt-"):-len(".index")])
                for p in glob.glob(os.path.join(model_dir, "checkpoints",
                                                "ckpt-*.index")))


def test_checkpoint_n_belongs_to_epoch_n(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  assert saver.chief
  assert saver.latest is None
  assert saver.save(1, step=3) == str(tmp_path / "checkpoints" / "ckpt-1")
  # Preempted 2 steps into epoch 3: the file is that epoch's, ckpt-3.
  assert saver.save(2, step=8, epoch_step=2) == str(
      tmp_path / "checkpoints" / "ckpt-3")
  assert saver.latest == str(tmp_path / "checkpoints" / "ckpt-3")
  assert _saved_numbers(tmp_path) == [1, 3]


def test_only_the_newest_max_to_keep_are_kept(tmp_path):
  saver = _checkpointer(tmp_path)
  for epoch in range(1, 6):
    saver.save(epoch, step=epoch * 4)
  assert _saved_numbers(tmp_path) == [3, 4, 5]


def test_restore_latest_returns_the_epoch_and_the_position(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  saver.save(1, step=3)
  saver.save(2, step=8, epoch_step=2)

  fresh = _checkpointer(tmp_path, seed=7)
  assert fresh.progress == checkpoints.Progress(0, 0, 0)
  assert fresh.restore_latest() == 2
  assert fresh.progress == checkpoints.Progress(epoch=2, epoch_step=2, step=8)
  assert fresh.latest == saver.latest
  restored, saved = fresh.checkpoint, saver.checkpoint
  for got, want in zip(restored.model.get_weights(),
                       saved.model.get_weights()):
    np.testing.assert_array_equal(got, want)
  assert int(restored.optimizer.iterations.numpy()) == 1


def test_save_keeps_the_last_step_unless_given(tmp_path):
  saver = _checkpointer(tmp_path)
  saver.save(1, step=5)
  saver.save(2)
  fresh = _checkpointer(tmp_path)
  assert fresh.restore_latest() == 2
  assert fresh.progress == checkpoints.Progress(epoch=2, epoch_step=0, step=5)
  # A resumed run saves its next epoch over no existing number.
  assert fresh.save(3, step=9) == str(tmp_path / "checkpoints" / "ckpt-3")
  assert _saved_numbers(tmp_path) == [1, 2, 3]


def test_nothing_to_restore_is_epoch_0(tmp_path):
  saver = _checkpointer(tmp_path)
  assert saver.restore_latest() == 0
  assert saver.progress == checkpoints.Progress()
  assert saver.latest is None


@pytest.mark.parametrize("epoch_step,number", [(0, 4), (1, 5)])
def test_progress_round_trips_through_the_files(tmp_path, epoch_step, number):
  saver = _checkpointer(tmp_path)
  path = saver.save(4, step=17, epoch_step=epoch_step)
  assert os.path.basename(path) == f"ckpt-{number}"
  assert [tf.train.load_variable(path, f"{v}/.ATTRIBUTES/VARIABLE_VALUE")
          for v in ("epoch", "epoch_step", "step")] == [4, epoch_step, 17]


# ----------------------------------------------------------- never torn


def _position(path):
  return [tf.train.load_variable(path, f"{v}/.ATTRIBUTES/VARIABLE_VALUE")
          for v in ("epoch", "epoch_step", "step")]


def test_a_resumed_run_never_saves_over_the_preemption_checkpoint(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  saver.save(1, step=3)
  preempted = saver.save(1, step=5, epoch_step=2)  # During epoch 2: ckpt-2.
  assert os.path.basename(preempted) == "ckpt-2"
  fresh = _checkpointer(tmp_path, seed=2)
  assert fresh.restore_latest() == 1
  # The end of epoch 2 takes the next number instead of rewriting ckpt-2.
  assert fresh.save(2, step=8) == str(tmp_path / "checkpoints" / "ckpt-3")
  assert fresh.save(3, step=12) == str(tmp_path / "checkpoints" / "ckpt-4")
  assert _position(preempted) == [1, 2, 5]
  assert _position(fresh.latest) == [3, 0, 12]
  assert _saved_numbers(tmp_path) == [2, 3, 4]
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")) == (
      fresh.latest)


def test_numbers_are_never_reused_even_after_pruning_or_a_partial_write(
    tmp_path):
  saver = _checkpointer(tmp_path)
  numbers = [os.path.basename(saver.save(1, step=s, epoch_step=s))
             for s in range(1, 6)]
  assert numbers == ["ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5", "ckpt-6"]
  assert _saved_numbers(tmp_path) == [4, 5, 6]
  # A save killed before its .index was written left a data file: skipped.
  with open(tmp_path / "checkpoints" / "ckpt-7.data-00000-of-00001", "wb") as f:
    f.write(b"partial")
  fresh = _checkpointer(tmp_path)
  assert fresh.restore_latest() == 1
  assert os.path.basename(fresh.save(7, step=9)) == "ckpt-8"


def test_files_and_directory_are_fsynced_before_the_state_file_names_them(
    tmp_path, monkeypatch):
  saver = _checkpointer(tmp_path)
  saver.save(1, step=1)
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    real_fsync(fd)

  def replace(src, dst):
    events.append(("replace", str(dst)))
    real_replace(src, dst)

  monkeypatch.setattr(checkpoints.os, "fsync", fsync)
  monkeypatch.setattr(checkpoints.os, "replace", replace)
  path = saver.save(2, step=2)
  directory = str(tmp_path / "checkpoints")
  state = ("replace", os.path.join(directory, "checkpoint"))
  assert state in events
  before = events[:events.index(state)]
  files = glob.glob(path + ".*")
  assert {os.path.basename(f) for f in files} == {
      "ckpt-2.index", "ckpt-2.data-00000-of-00001"}
  for name in files + [directory]:
    assert ("fsync", name) in before, (name, events)
  # The state file's own bytes too, and the directory after the rename.
  assert events[-1] == ("fsync", directory)


def _damage(path, how):
  """Damages checkpoint `path` the way a full disk, a kill or a user does."""
  data, index = path + ".data-00000-of-00001", path + ".index"
  if how == "truncated data":
    with open(data, "r+b") as f:
      f.truncate(os.path.getsize(data) // 2)
  elif how == "emptied index":
    open(index, "wb").close()
  elif how == "garbage index":
    with open(index, "wb") as f:
      f.write(os.urandom(64))
  elif how == "deleted data":
    os.remove(data)
  elif how == "deleted index":
    os.remove(index)
  elif how == "flipped data":
    with open(data, "r+b") as f:
      f.seek(os.path.getsize(data) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0xFF]))


DAMAGES = ["truncated data", "emptied index", "garbage index", "deleted data",
           "deleted index", "flipped data"]


def _two_epochs(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  older = saver.save(1, step=3)
  weights = [w.copy() for w in saver.checkpoint.model.get_weights()]
  saver.checkpoint.model.set_weights(
      [w + 1 for w in saver.checkpoint.model.get_weights()])
  newest = saver.save(2, step=6)
  return older, newest, weights


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(
    tmp_path, caplog, how):
  older, newest, weights = _two_epochs(tmp_path)
  _damage(newest, how)
  fresh = _checkpointer(tmp_path, seed=7)
  assert fresh.restore_latest() == 1
  assert fresh.progress == checkpoints.Progress(epoch=1, epoch_step=0, step=3)
  for got, want in zip(fresh.checkpoint.model.get_weights(), weights):
    np.testing.assert_array_equal(got, want)
  assert fresh.latest == older
  assert f"Skipping checkpoint {newest}: it does not read back (" in caplog.text
  # The next save neither reuses ckpt-2 nor deletes ckpt-1 on its account.
  assert os.path.basename(fresh.save(2, step=6)) == "ckpt-3"
  assert 1 in _saved_numbers(tmp_path)


def test_a_skipped_checkpoint_does_not_push_out_the_readable_ones(tmp_path):
  """Found by a new user: after a resume fell back past a damaged ckpt-2,
  the next saves deleted the readable ckpt-1 (and the one it resumed
  from) while the damaged one, counted among the 3 kept, stayed. Now a
  skipped checkpoint is left on disk but not counted."""
  _, newest, _ = _two_epochs(tmp_path)
  _damage(newest, "flipped data")
  fresh = _checkpointer(tmp_path, seed=7)
  assert fresh.restore_latest() == 1
  for epoch in (2, 3):
    fresh.save(epoch, step=3 * epoch)
  # ckpt-2 (damaged) is not one of the 3 kept: 1, 3 and 4 are.
  assert _saved_numbers(tmp_path) == [1, 2, 3, 4]
  fresh.save(4, step=12)
  assert _saved_numbers(tmp_path) == [2, 3, 4, 5]
  state = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints"))
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
      "ckpt-3", "ckpt-4", "ckpt-5"]


@pytest.mark.parametrize("state", ["missing", "garbage", "empty",
                                   "names a deleted checkpoint"])
def test_checkpoints_are_found_without_a_readable_state_file(tmp_path, state):
  _, newest, _ = _two_epochs(tmp_path)
  state_file = tmp_path / "checkpoints" / "checkpoint"
  if state == "missing":
    os.remove(state_file)
  elif state == "garbage":
    state_file.write_bytes(b"\x00\xffnot a proto {{{")
  elif state == "empty":
    state_file.write_bytes(b"")
  else:
    state_file.write_text('model_checkpoint_path: "ckpt-9"\n'
                          'all_model_checkpoint_paths: "ckpt-9"\n')
  fresh = _checkpointer(tmp_path, seed=7)
  assert fresh.restore_latest() == 2
  assert fresh.progress == checkpoints.Progress(epoch=2, epoch_step=0, step=6)
  assert fresh.latest == newest
  # Saving afterwards takes a new number and keeps the older checkpoints.
  assert os.path.basename(fresh.save(3, step=9)) == "ckpt-3"
  assert _saved_numbers(tmp_path)[:2] == [1, 2]


def test_when_no_checkpoint_reads_back_restore_refuses_to_start_over(
    tmp_path):
  older, newest, _ = _two_epochs(tmp_path)
  _damage(older, "garbage index")
  _damage(newest, "deleted data")
  fresh = _checkpointer(tmp_path, seed=7)
  directory = str(tmp_path / "checkpoints")
  with pytest.raises(checkpoints.UnreadableCheckpointError,
                     match=rf"No checkpoint in {re.escape(directory)} reads "
                     r"back: ckpt-2 \(.+No such file.+\); ckpt-1 \(not an "
                     r"sstable.+\) \(files: "
                     r"ckpt-1\.data-00000-of-00001, ckpt-1\.index, "
                     r"ckpt-2\.index\)\. Not training from scratch over them"):
    fresh.restore_latest()


def test_a_state_file_naming_only_deleted_checkpoints_starts_over(
    tmp_path, caplog):
  directory = tmp_path / "checkpoints"
  directory.mkdir()
  (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-4"\n')
  fresh = _checkpointer(tmp_path)
  assert fresh.restore_latest() == 0
  assert "no checkpoint file exists: starting from scratch" in caplog.text
  assert os.path.basename(fresh.save(1, step=2)) == "ckpt-1"


def test_a_placed_models_checkpoint_from_before_the_portable_view_resumes(
    tmp_path, cpu_devices):
  """Placed models' checkpoints now also hold the weights by layer name
  (`portable`); one written before that (no view) still resumes, every
  object matched, and the next save holds the view."""
  from tfmgpu.parallel import staged  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import portable  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                            keras.layers.Dense(2)])
  split = staged.StagedModel.from_model(model, num_stages=2)
  optimizer = split.build_optimizer(keras.optimizers.Adam())
  old = tf.train.Checkpoint(  # What tfmgpu wrote before.
      model=split, optimizer=optimizer,
      epoch=tf.Variable(1, dtype=tf.int64),
      epoch_step=tf.Variable(0, dtype=tf.int64),
      step=tf.Variable(5, dtype=tf.int64))
  old.save_counter.assign_add(1)
  os.makedirs(tmp_path / "checkpoints")
  old.write(str(tmp_path / "checkpoints" / "ckpt-1"))
  checkpointer = checkpoints.Checkpointer(
      str(tmp_path), tf.distribute.get_strategy(), model=split,
      optimizer=optimizer)
  assert checkpointer.restore_latest() == 1
  assert checkpointer.progress.step == 5
  assert checkpointer.epoch_sums == ""  # Nor the epoch's sums then.
  assert portable.has_view(checkpointer.save(2, step=6))
  again = checkpoints.Checkpointer(
      str(tmp_path), tf.distribute.get_strategy(), model=split,
      optimizer=optimizer)
  assert again.restore_latest() == 2


def test_the_epochs_sums_round_trip_and_an_epoch_end_holds_none(tmp_path):
  saver = _checkpointer(tmp_path, seed=1)
  saver.save(0, step=2, epoch_step=2, epoch_sums='{"steps": 2}')
  restored = _checkpointer(tmp_path)
  restored.restore_latest()
  assert restored.epoch_sums == '{"steps": 2}'
  saver.save(1, step=4)
  restored.restore_latest()
  assert restored.epoch_sums == ""


def _named(model_dir, units, optimizer):
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
      units, name="h"), keras.layers.Dense(2, name="out")])
  optimizer.build(model.trainable_variables)
  return checkpoints.Checkpointer(
      str(model_dir), tf.distribute.get_strategy(), model=model,
      optimizer=optimizer)


@pytest.mark.parametrize("units,optimizer,differs", [
    (4, lambda: keras.optimizers.SGD(momentum=0.9),
     r"'sgd\w*/\w*h_bias_momentum' is \(4,\) here, \(3, 4\) there"),
    (5, keras.optimizers.Adam,
     r"'\w+/h/kernel' is \(3, 5\) here, \(3, 4\) there"),
])
def test_checkpoints_of_another_optimizer_or_model_are_said_to_be_so(
    tmp_path, units, optimizer, differs):
  """Resumed with SGD over an Adam run (or a wider model) it said "No
  checkpoint reads back ... restore the directory from a copy", as if the
  files were damaged."""
  _named(tmp_path, 4, keras.optimizers.Adam()).save(1, step=3)
  with pytest.raises(checkpoints.OtherRunCheckpointError, match=(
      r"are of another model or optimizer than this run's: ckpt-1 reads "
      r"back whole, but its variables do not match \(" + differs
      + r".*give another model_dir to start a new run \(the checkpoints "
      r"are left as they are\)")):
    _named(tmp_path, units, optimizer()).restore_latest()
  assert _saved_numbers(tmp_path) == [1]


def test_a_relative_model_dir_names_each_checkpoint_once(
    tmp_path, monkeypatch, caplog):
  """Issue 29 item 7: TF joins the state file's names to the directory
  already; joining again named `runs/x/checkpoints/runs/x/checkpoints/...`,
  which failed to read and was logged as damage."""
  monkeypatch.chdir(tmp_path)
  saver = _checkpointer(os.path.join("runs", "x"), seed=1)
  saver.save(1, step=3)
  saver.save(2, step=6)
  fresh = _checkpointer(os.path.join("runs", "x"), seed=7)
  # Named absolutely (multi-worker ZeRO's serving task writes from its own
  # working directory).
  directory = os.path.abspath(os.path.join("runs", "x", "checkpoints"))
  assert fresh.candidates() == [os.path.join(directory, "ckpt-2"),
                                os.path.join(directory, "ckpt-1")]
  caplog.set_level("INFO")
  assert fresh.restore_latest() == 2
  assert "Skipping" not in caplog.text
  assert (f"Resumed from {os.path.join(directory, 'ckpt-2')}: after 2 whole "
          "epochs, global step 6." in caplog.text)


def test_the_resume_line_says_where_in_the_epoch_it_stands(tmp_path, caplog):
  saver = _checkpointer(tmp_path, seed=1)
  saver.save(1, step=3)
  caplog.set_level("INFO")
  _checkpointer(tmp_path).restore_latest()
  assert ": after 1 whole epoch, global step 3." in caplog.text
  saver.save(1, step=5, epoch_step=2)
  _checkpointer(tmp_path).restore_latest()
  assert ": epoch 2, step 2 of it, global step 5." in caplog.text


def test_a_resume_whose_variables_come_in_another_order_is_refused(
    tmp_path):
  """Optimizer slots restore by position: a model listing the same
  variables in another order (a resume in another layout) would get other
  weights' moments without an error, so it is refused, naming the order."""
  from tfmgpu.training import slot_order  # pylint: disable=g-import-not-at-top
  saver = _checkpointer(tmp_path, seed=1)
  saver.save(1, step=1)
  directory = str(tmp_path / "checkpoints")
  saved = slot_order.order_of(saver.checkpoint.model)
  with open(os.path.join(directory, slot_order.FILE_NAME)) as f:
    assert f.read().splitlines() == saved
  assert len(saved) == 2 and saved[0] != saved[1]
  slot_order.check(directory, saved)  # The same order: fine.
  slot_order.check(directory, saved + ["other/kernel"])  # Other variables.
  with pytest.raises(slot_order.SlotOrderError,
                     match=re.escape(f"position 0: {saved[0]!r} then, "
                                     f"{saved[1]!r} now")):
    slot_order.check(directory, saved[::-1])
  os.remove(os.path.join(directory, slot_order.FILE_NAME))
  slot_order.check(directory, saved[::-1])  # Older checkpoints: no record.


def test_a_workers_temporary_directory_goes_without_close(tmp_path):
  # Worker 1 of two keeps no checkpoints: its copies go to a temporary
  # directory, removed when the checkpointer is collected (or Python exits:
  # tests/cluster/test_multi_worker.py) even if nobody calls close().
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["a:1", "b:1"]}), task_type="worker",
      task_id=1)
  model, optimizer = _model_and_optimizer(0)
  saver = checkpoints.Checkpointer(
      str(tmp_path), types.SimpleNamespace(cluster_resolver=resolver),
      model=model, optimizer=optimizer)
  assert not saver.chief
  saver.save(1, step=2)
  directory = saver.directory
  assert os.path.exists(os.path.join(directory, "ckpt-1.index"))
  del saver
  gc.collect()
  assert not os.path.exists(directory)
  assert not os.path.exists(tmp_path / "checkpoints" / "ckpt-1.index")


def test_a_killed_workers_temporary_directory_goes_at_the_next_start(
    tmp_path, monkeypatch):
  """A non-chief worker SIGKILLed (no finalizer runs) left its
  /tmp/tfmgpu-ckpt-* (a whole checkpoint copy) for good. Its name now
  carries its PID, PID namespace and host; the next Checkpointer removes
  those of its namespace whose process is gone, and nothing else: a
  container sharing /tmp and the host name (another PID namespace) sees
  a live worker's PID as gone, and removed its copy."""
  monkeypatch.setattr(checkpoints.tempfile, "tempdir", str(tmp_path))
  with open("/proc/sys/kernel/pid_max") as f:
    dead = int(f.read()) + 1  # A PID no process can have.
  host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
  ns = f"pidns{os.stat('/proc/self/ns/pid').st_ino}"
  names = {"stale": f"tfmgpu-ckpt-{dead}-{ns}-{host}-k3j_x9a1",
           # Claimed by a sweep (renamed) that was killed before its rmtree.
           "half swept": f"tfmgpu-ckpt-{dead}-{ns}-{host}-k3j_x9a2.x{dead}",
           # Claimed by a sweep still at work (another worker's): its own.
           "being swept": f"tfmgpu-ckpt-{dead}-{ns}-{host}-k3j_x9a3"
                          f".x{os.getpid()}",
           "live": f"tfmgpu-ckpt-{os.getpid()}-{ns}-{host}-abcdefgh",
           "other namespace": f"tfmgpu-ckpt-{dead}-pidns1-{host}-abcdefgh",
           "no namespace": f"tfmgpu-ckpt-{dead}-{host}-abcdefgh",
           "other host": f"tfmgpu-ckpt-{dead}-{ns}-elsewhere-abcdefgh",
           "older tfmgpu": "tfmgpu-ckpt-abcdefgh",
           "not ours": f"other-{dead}-{ns}-{host}-abcdefgh"}
  for name in names.values():
    os.makedirs(tmp_path / name)
    open(tmp_path / name / "ckpt-1.index", "wb").close()
    if name != names["live"]:  # Written long ago (a rename keeps the
      os.utime(tmp_path / name, (1e9, 1e9))  # mtime; the ctime is now).
  a_file = tmp_path / f"tfmgpu-ckpt-{dead}-{ns}-{host}-afile123"
  a_file.write_bytes(b"")
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["a:1", "b:1"]}), task_type="worker",
      task_id=1)
  model, optimizer = _model_and_optimizer(0)
  worker = checkpoints.Checkpointer(
      str(tmp_path / "run"), types.SimpleNamespace(cluster_resolver=resolver),
      model=model, optimizer=optimizer)
  assert not (tmp_path / names.pop("stale")).exists()
  assert not (tmp_path / names.pop("half swept")).exists()
  assert [p.name for p in tmp_path.glob("*.x*")] == [names["being swept"]]
  assert all((tmp_path / name).is_dir() for name in names.values())
  assert a_file.exists()
  # Its own directory tells its PID, namespace and host the same way.
  assert os.path.basename(worker.directory).startswith(
      f"tfmgpu-ckpt-{os.getpid()}-{ns}-{host}-")
  worker.close()


def test_an_uncaught_preemption_exits_42_as_the_cli_does():
  """A user's script that let `PreemptedError` out exited 1: a launcher
  read it as a failure (a new user's trial). A caught one changes
  nothing."""
  script = (
      "from tfmgpu.training.checkpoints import PreemptedError\n"
      "try:\n"
      "  raise PreemptedError('caught', checkpoint=None, step=1)\n"
      "except PreemptedError:\n"
      "  print('went on', flush=True)\n"
      "raise PreemptedError('saved ckpt-3', checkpoint='ckpt-3', step=7)\n")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == checkpoints.EXIT_PREEMPTED, done.stderr
  assert done.stdout == "went on\n"
  assert "PreemptedError: saved ckpt-3" in done.stderr  # Printed as before.
