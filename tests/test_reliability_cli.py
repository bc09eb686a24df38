"""Issue 16 through the command lines, in-process: each bad input ends in one
`error:` naming the path or value and what to do, before work starts where
it can be checked; the run directory's record refuses what a resume cannot
change and applies what it may."""

import dataclasses
import errno
import json
import logging
import os
import re
import selectors
import subprocess
import sys

from absl.testing import flagsaver
import numpy as np
import pytest

from tfmgpu import cluster
from tfmgpu import data
from tfmgpu import models
from tfmgpu import predict
from tfmgpu import rundir
from tfmgpu import train
from tfmgpu.config import TrainConfig

pytestmark = pytest.mark.usefixtures("parsed_flags")

TIMEOUT_S = 60
TINY = dict(strategy="one_device", model="mlp", epochs=1, steps_per_epoch=2,
            steps_per_execution=1, verbose=0)


def _error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith("error: ")]
  assert len(lines) == 1, err
  return lines[0]


# ---------------------------------------------------------------- train


@pytest.mark.parametrize("how", ["file", "under a file"])
def test_a_model_dir_that_cannot_be_a_directory(tmp_path, capsys, how):
  (tmp_path / "f").write_text("x")
  path = str(tmp_path / "f") if how == "file" else str(tmp_path / "f" / "x")
  with flagsaver.flagsaver(**TINY, model_dir=path):
    assert train.main(["train"]) == 1
  line = _error_line(capsys)
  assert line.startswith(f"error: model_dir={path!r} ")
  assert ("is a regular file, not a directory" if how == "file" else
          "cannot be created (Not a directory). Choose a path") in line


def test_a_resume_refuses_other_settings_and_applies_a_new_learning_rate(
    tmp_path, capsys, caplog):
  caplog.set_level(logging.INFO)
  model_dir = str(tmp_path / "run")
  with flagsaver.flagsaver(**TINY, model_dir=model_dir):
    assert train.main(["train"]) == 0
  capsys.readouterr()
  with flagsaver.flagsaver(**TINY, model_dir=model_dir, seed=1,
                           optimizer="sgd"):
    assert train.main(["train"]) == 1
  assert capsys.readouterr().err == (
      f"error: model_dir={model_dir!r} holds a run whose checkpoints depend "
      "on settings this run changes:\n"
      "  optimizer: 'adam' -> 'sgd' (--optimizer)\n"
      "  seed: 0 -> 1 (--seed)\n"
      "Run again with the old values to resume it, or use a new "
      "--model_dir to start another run.\n")

  with flagsaver.flagsaver(**{**TINY, "epochs": 2}, model_dir=model_dir,
                           learning_rate=1e-4):
    assert train.main(["train"]) == 0
  assert re.search(r"learning_rate: .*ckpt-1 holds 0\.002; training with "
                   r"the 0\.0001 given to this run\.", caplog.text)
  record = json.loads((tmp_path / "run" / rundir.RECORD_NAME).read_text())
  assert (record["learning_rate"], record["epochs"]) == (1e-4, 2)
  assert not (tmp_path / "run" / rundir.LOCK_NAME).exists()


def test_without_run_json_a_wrong_model_names_the_mismatch_and_writes_nothing(
    tmp_path, capsys):
  """Issue 29 item 3: run.json deleted (what its own error advises) and a
  wrong --model: a clear error, and no record naming the wrong model, so
  the right command resumes afterwards and records itself."""
  model_dir = str(tmp_path / "run")
  with flagsaver.flagsaver(**TINY, model_dir=model_dir):
    assert train.main(["train"]) == 0
  record = tmp_path / "run" / rundir.RECORD_NAME
  record.unlink()
  capsys.readouterr()
  with flagsaver.flagsaver(**{**TINY, "model": "convnet"}, model_dir=model_dir):
    assert train.main(["train"]) == 1
  line = _error_line(capsys)
  assert line.startswith(f"error: model_dir={model_dir!r} has no run.json, "
                         "and its checkpoints do not restore into this run "
                         "(model='convnet', ")
  assert "ckpt-1 (Received incompatible tensor" in line
  assert "run again with the --model" in line
  assert not record.exists()
  with flagsaver.flagsaver(**{**TINY, "epochs": 2}, model_dir=model_dir):
    assert train.main(["train"]) == 0
  assert json.loads(record.read_text())["model"] == "mlp"


def test_a_blank_run_json_beside_checkpoints_is_refused(tmp_path, capsys):
  """Issue 29 item 3: `{}` let --seed=1 continue seed 0's checkpoints."""
  model_dir = str(tmp_path / "run")
  with flagsaver.flagsaver(**TINY, model_dir=model_dir):
    assert train.main(["train"]) == 0
  (tmp_path / "run" / rundir.RECORD_NAME).write_text("{}")
  capsys.readouterr()
  with flagsaver.flagsaver(**TINY, model_dir=model_dir, seed=1):
    assert train.main(["train"]) == 1
  line = _error_line(capsys)
  assert "run.json is {}: it names none of the settings" in line
  assert "Delete it to resume" in line


def test_a_live_run_keeps_a_second_one_out(tmp_path, capsys):
  model_dir = str(tmp_path / "run")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys; from tfmgpu import rundir; "
       "rundir.RunLock(sys.argv[1]).acquire(); print('held', flush=True); "
       "sys.stdin.readline()", model_dir],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    with selectors.DefaultSelector() as selector:
      selector.register(holder.stdout, selectors.EVENT_READ)
      assert selector.select(TIMEOUT_S), "the lock holder said nothing"
    assert holder.stdout.readline() == "held\n"
    with flagsaver.flagsaver(**TINY, model_dir=model_dir):
      assert train.main(["train"]) == 1
  finally:
    holder.communicate("", timeout=TIMEOUT_S)
  line = _error_line(capsys)
  assert re.match(rf"error: model_dir={re.escape(repr(model_dir))} is in use "
                  rf"by a live run: PID {holder.pid} on host \S+, started", line)
  assert not (tmp_path / "run" / rundir.RECORD_NAME).exists()  # Untouched.


def test_a_full_disk_is_one_error_line_naming_the_path(tmp_path, capsys,
                                                       monkeypatch):
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "run" / "model.keras")

  def disk_full(config, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", path)

  monkeypatch.setattr(runs, "run_training", disk_full)
  with flagsaver.flagsaver(**TINY, model_dir=str(tmp_path / "run")):
    assert train.main(["train"]) == 1
  assert _error_line(capsys) == (
      f"error: disk full while writing {path} (No space left on device): "
      "free space on that filesystem (or write elsewhere) and run the same "
      "command again.")


def test_only_the_chief_takes_the_lock_and_writes_the_record():
  spec = {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}
  role = lambda t, i=0, s=spec: cluster.TaskRole(t, i, s)
  ps, mwms = (TrainConfig(strategy="parameter_server").cluster_target,
              TrainConfig(strategy="multi_worker_mirrored").cluster_target)
  assert cluster.writes_outputs(role("chief"), ps)
  assert not cluster.writes_outputs(role("worker"), ps)
  workers = {"worker": ["a:1", "b:1"]}
  assert cluster.writes_outputs(role("worker", 0, workers), mwms)
  assert not cluster.writes_outputs(role("worker", 1, workers), mwms)
  slurm = dataclasses.replace(mwms, cluster_resolver="slurm")
  assert not cluster.writes_outputs(cluster.TaskRole(), slurm,
                                    {"SLURM_PROCID": "1"})
  assert cluster.writes_outputs(cluster.TaskRole(), slurm, {"SLURM_PROCID": "0"})
  assert cluster.writes_outputs(cluster.TaskRole(),
                                TrainConfig().cluster_target,
                                {"SLURM_PROCID": "3"})


# -------------------------------------------------------------- predict


def test_sigterm_in_the_final_evaluation_says_what_is_kept_and_exits_42(
    tmp_path, capsys, monkeypatch):
  """SIGTERM after training (the final evaluation; likewise the save of
  model.keras) killed the CLI with 143, no word, and left run.lock (fault
  trial n, repro_term_after_training.sh)."""
  import signal  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import loop  # pylint: disable=g-import-not-at-top
  evaluate = loop.Trainer.evaluate

  def terminated(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(self, *args, **kwargs)
  monkeypatch.setattr(loop.Trainer, "evaluate", terminated)
  model_dir = tmp_path / "run"

  def killed(signum, frame):  # What SIGTERM did: kill (not the test).
    pytest.fail("SIGTERM reached the default handler: exit 143")
  previous = signal.signal(signal.SIGTERM, killed)
  try:
    with flagsaver.flagsaver(**TINY, model_dir=str(model_dir)):
      assert train.main(["train"]) == 42
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert _error_line(capsys) == (
      "error: Preempted: SIGTERM reached this process outside the training "
      "steps (before them, in the final evaluation or while model.keras was "
      f"saved) and stopped it at once. The checkpoints in {model_dir} are "
      "kept, the latest with the weights trained so far (model.keras is "
      "written whole or not at all). Run the same command again to resume; "
      "once training is done it evaluates and saves the model (python -m "
      "tfmgpu.train exits with code 42).")
  assert sorted(os.listdir(model_dir)) == [
      "checkpoints", "run.json", "summaries"]  # No run.lock.
  monkeypatch.setattr(loop.Trainer, "evaluate", evaluate)
  with flagsaver.flagsaver(**TINY, model_dir=str(model_dir)):
    assert train.main(["train"]) == 0  # Nothing to train: evaluates, saves.
  assert (model_dir / "model.keras").exists()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("model") / "m.keras")
  models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10,
                     seed=0).save(path)
  return path


def test_ctrl_c_in_predict_is_one_line_and_keeps_the_output(
    tmp_path, capsys, monkeypatch):
  """Ctrl-C while predicting printed a KeyboardInterrupt traceback."""
  class Interrupted:  # A stand-in predictor: Ctrl-C while it predicts.
    def predict(self, x):
      raise KeyboardInterrupt

  monkeypatch.setattr(predict, "_prepare", lambda: (
      Interrupted(), np.zeros((4, 3), np.float32), None))
  (tmp_path / "m.keras").write_text("a model")
  out = tmp_path / "p.npy"
  out.write_bytes(b"the previous predictions")
  with flagsaver.flagsaver(model_path=[str(tmp_path / "m.keras")],
                           output=str(out)):
    try:
      assert predict.main(["predict"]) == 130
    except KeyboardInterrupt:
      pytest.fail("Ctrl-C reached the caller: a traceback")
  assert _error_line(capsys) == (
      f"error: interrupted (Ctrl-C): --output={out} was not written (a file "
      "there before is unchanged).")
  assert out.read_bytes() == b"the previous predictions"


def test_predict_output_that_is_a_directory_fails_before_predicting(
    tmp_path, capsys, monkeypatch, model_path):
  monkeypatch.setattr(predict, "_prepare", lambda: pytest.fail("predicted"))
  with flagsaver.flagsaver(model_path=[model_path], output=str(tmp_path)):
    assert predict.main(["predict"]) == 1
  assert _error_line(capsys) == (
      f"error: --output={str(tmp_path)!r} is a directory; give a file path, "
      f"e.g. {str(tmp_path / 'predictions.npy')!r}.")
  (tmp_path / "f").write_text("x")
  with flagsaver.flagsaver(model_path=[model_path],
                           output=str(tmp_path / "f" / "p.npy")):
    assert predict.main(["predict"]) == 1
  assert "is a file, not a directory. Choose another path." in (
      _error_line(capsys))


def test_predict_on_a_full_disk_says_disk_full(tmp_path, capsys, monkeypatch,
                                               model_path):
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "p.npy")

  def short_write(path, predictions):
    raise OSError("10000 requested and 4064 written")  # numpy's words.

  monkeypatch.setattr(inference, "save_predictions", short_write)
  with flagsaver.flagsaver(model_path=[model_path], output=out,
                           strategy="default"):
    assert predict.main(["predict"]) == 1
  assert _error_line(capsys).startswith(f"error: disk full while writing {out}")


# ----------------------------------------------------------------- data


def _npz(path, **changes):
  rng = np.random.default_rng(0)
  arrays = dict(x_train=rng.random((64, 8), np.float32),
                y_train=rng.integers(0, 3, 64), x_test=rng.random(
                    (8, 8), np.float32), y_test=rng.integers(0, 3, 8))
  arrays.update(changes)
  np.savez(path, **arrays)
  return str(path)


@pytest.mark.parametrize("how,why", [
    ("empty", r"0 bytes: No data left in file"),
    ("garbage", r"500 bytes: This file contains pickled \(object\) data"),
    ("truncated", r"\d+ bytes: File is not a zip file"),
    ("one array", r"\d+ bytes: one array \(a \.npy file\), not an archive"),
])
def test_a_damaged_npz_is_named(tmp_path, how, why):
  path = str(tmp_path / "d.npz")
  good = open(_npz(path), "rb").read()
  if how == "one array":
    with open(path, "wb") as f:
      np.save(f, np.zeros(3))
  else:
    open(path, "wb").write({"empty": b"", "garbage": b"\x00" * 500,
                            "truncated": good[:len(good) // 2]}[how])
  with pytest.raises(ValueError, match=(
      rf"^dataset 'npz': path={re.escape(repr(path))} is not a valid \.npz "
      rf"file \({why}.*\)\. Write it with numpy\.savez\(path, x_train=")):
    data.load_dataset("npz", path=path)


def test_npz_labels_are_checked_before_training(tmp_path, capsys):
  y = np.zeros(64, np.int64)
  y[5] = -1
  path = _npz(tmp_path / "labels.npz", y_train=y)
  with flagsaver.flagsaver(**TINY, dataset="npz", data_path=path,
                           global_batch_size=16,
                           model_dir=str(tmp_path / "run")):
    assert train.main(["train"]) == 1
  assert _error_line(capsys) == (
      f"error: dataset {path!r}: y_train[5]=-1 is outside the class range "
      "0..2 (1 label(s) out of range). Labels must be integer class indices "
      "from 0 to num_classes - 1: fix the labels.")
  assert not (tmp_path / "run" / "checkpoints").exists()
  with pytest.raises(ValueError, match=r"y_train in .* holds non-integer "
                     r"labels"):
    data.load_dataset("npz", path=_npz(tmp_path / "f.npz",
                                       y_train=np.full(64, 0.5)))
  # A NaN in the inputs read as a learning rate too high at step 20.
  x = np.random.RandomState(0).normal(size=(64, 12)).astype("float32")
  x[9, 3] = np.nan
  path = _npz(tmp_path / "nan.npz", x_train=x)
  with flagsaver.flagsaver(**TINY, dataset="npz", data_path=path,
                           global_batch_size=16):
    assert train.main(["train"]) == 1
  assert _error_line(capsys) == (
      f"error: dataset {path!r}: x_train holds 1 NaN/inf value(s), the first "
      "in row 9; the loss would turn NaN at the step that reads it. Clean "
      "the data first (drop those rows, or np.nan_to_num).")


# ------------------------------------------------------- damaged TFRecords


@pytest.fixture(scope="module")
def shards(tmp_path_factory, digits_arrays):
  """The digits as 4 shards per split (copied before damage)."""
  from tfmgpu.datasets import tfrecord  # pylint: disable=g-import-not-at-top
  directory = tmp_path_factory.mktemp("tfr") / "digits"
  tfrecord.write_shards(digits_arrays, str(directory), num_shards=4)
  return directory


def _damaged_copy(shards, tmp_path, name: str, content) -> str:
  import shutil  # pylint: disable=g-import-not-at-top
  copy = tmp_path / "shards"
  shutil.copytree(shards, copy)
  data = (copy / name).read_bytes()
  (copy / name).write_bytes(content(data))
  return str(copy / name)


def _flip(data: bytes) -> bytes:
  middle = len(data) // 2
  return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 8]) + (
      data[middle + 8:])


@pytest.mark.parametrize("how,content", [
    ("emptied", lambda data: b""),
    ("cut mid-record", lambda data: data[:len(data) * 2 // 3]),
    ("flipped bytes", _flip)])
def test_predict_on_a_damaged_shard_names_it(shards, tmp_path, capsys,
                                             model_path, how, content):
  """Issue 29 item 1: predict exited 0 with rows missing, or a traceback."""
  shard = _damaged_copy(shards, tmp_path, "test-00001-of-00004.tfrecord",
                        content)
  with flagsaver.flagsaver(model_path=[model_path], strategy="default",
                           dataset="tfrecord",
                           data_path=f"{tmp_path}/shards/*.tfrecord"):
    assert predict.main(["predict"]) == 1
  line = _error_line(capsys)
  assert line.startswith(f"error: TFRecord shard {shard} is damaged: "), line
  assert "--skip_damaged_shards" not in line


def test_training_on_flipped_bytes_names_the_shard_and_skips_it_if_asked(
    shards, tmp_path, capsys, caplog):
  """Issue 29 item 1: a raw DataLossError traceback in training."""
  shard = _damaged_copy(shards, tmp_path, "train-00002-of-00004.tfrecord",
                        _flip)
  run = dict(TINY, dataset="tfrecord",
             data_path=f"{tmp_path}/shards/*.tfrecord")
  with flagsaver.flagsaver(**run, model_dir=str(tmp_path / "a")):
    assert train.main(["train"]) == 1
  line = _error_line(capsys)
  assert line.startswith(f"error: TFRecord shard {shard} is damaged: the "
                         "record at byte ")
  assert "train without it: --skip_damaged_shards" in line
  with flagsaver.flagsaver(**run, model_dir=str(tmp_path / "b"),
                           skip_damaged_shards=True):
    assert train.main(["train"]) == 0
  assert f"Skipping damaged TFRecord shard {shard}" in caplog.text
  assert "Reading 3 train files (3000 examples), 4 test files" in caplog.text


@pytest.mark.parametrize("how", ["cut at a record boundary", "deleted"])
def test_a_shard_damaged_while_training_is_named(shards, tmp_path, capsys,
                                                  monkeypatch, how):
  """Damaged after the start-up check (here: as the Trainer is made): a
  shard cut at a record boundary was read short, exit 0 with other
  weights; one deleted gave a 92-line NotFoundError traceback (fault trial
  n, repro_tfr_cut_midrun.sh, repro_tfr_rm_midrun.sh)."""
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top
  shard = _damaged_copy(shards, tmp_path, "train-00001-of-00004.tfrecord",
                        lambda data: data)
  record = os.path.getsize(shard) // 1000

  def damage_then_make(*args, make=runs.make_trainer, **kwargs):
    if how == "deleted":
      os.remove(shard)
    else:
      with open(shard, "r+b") as f:
        f.truncate(999 * record)
    return make(*args, **kwargs)
  monkeypatch.setattr(runs, "make_trainer", damage_then_make)
  with flagsaver.flagsaver(**TINY, dataset="tfrecord", model_dir=str(
      tmp_path / "run"), data_path=f"{tmp_path}/shards/*.tfrecord"):
    assert train.main(["train"]) == 1
  why = ("it is missing (tfrecord.json lists it with 1000 examples)"
         if how == "deleted" else "it holds 999 records, tfrecord.json lists "
         "1000: it was cut or changed")
  assert _error_line(capsys) == (
      f"error: TFRecord shard {shard} is damaged: {why}. Restore it, or "
      "rewrite the shards with python scripts/write_tfrecords.py; or train "
      "without it: --skip_damaged_shards (TFRecordSource("
      "skip_damaged_shards=True)).")


# ------------------------------------------ errors before TensorFlow loads


def _cli_without_tensorflow(module, *args, cwd):
  """Runs `python -m module args`; returns its one `error:` line, checking
  that TensorFlow was never imported (`-X importtime` lists each import)."""
  out = subprocess.run(
      [sys.executable, "-X", "importtime", "-m", module, *args], cwd=cwd,
      capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
  assert out.returncode == 1, out.stderr[-2000:]
  assert not re.search(r"\|\s*tensorflow$", out.stderr, re.M), (
      "TensorFlow was imported before the error")
  return [l for l in out.stderr.splitlines() if l.startswith("error: ")]


def test_errors_that_need_no_tensorflow_come_before_it(tmp_path):
  """Issue 29 item 6: each took 5-23 s of TF loading first."""
  (tmp_path / "a_file").write_text("")
  assert _cli_without_tensorflow(
      "tfmgpu.train", "--model_dir=a_file", cwd=tmp_path) == [
          "error: model_dir='a_file' is a regular file, not a directory. Give "
          "a directory: a new path, or the model_dir of the run to resume."]
  lock = rundir.RunLock(str(tmp_path / "held")).acquire()
  try:
    held = _cli_without_tensorflow("tfmgpu.train", "--model_dir=held",
                                   cwd=tmp_path)
  finally:
    lock.release()
  assert len(held) == 1 and "is in use by a live run" in held[0]
  assert _cli_without_tensorflow(
      "tfmgpu.train", "--strategy=pipeline", "--model=mlp", "--num_stages=9",
      "--model_dir=stages", cwd=tmp_path) == [
          "error: num_stages=9 but model 'mlp' has only 4 cuttable block(s) "
          "(one per layer call; a stage needs at least one). Use "
          "num_stages<=4."]
  assert not (tmp_path / "stages").exists()
  assert _cli_without_tensorflow(
      "tfmgpu.predict", "--model_path=nope.keras", cwd=tmp_path) == [
          "error: model_path='nope.keras' does not exist. Train one with "
          "`python -m tfmgpu.train --model_dir=DIR` (it saves "
          "DIR/model.keras)."]


# ------------------------------------------- run.json names files absolutely

LOADER = '''
import numpy as np


def load():
  rng = np.random.default_rng(0)
  def split(n):
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)
  return split(128), split(40)
'''


def test_predict_finds_the_users_loader_from_another_directory(
    tmp_path, capsys, caplog, monkeypatch):
  """Issue 29 item 10: `run.json` recorded `loader.py:load` as given, so
  `predict` from another directory failed on a `--dataset` nobody gave."""
  caplog.set_level(logging.INFO)
  (tmp_path / "code").mkdir()
  (tmp_path / "code" / "loader.py").write_text(LOADER)
  loader = str(tmp_path / "code" / "loader.py")
  monkeypatch.chdir(tmp_path / "code")
  with flagsaver.flagsaver(**TINY, dataset="loader.py:load",
                           model_dir="../run"):
    assert train.main(["train"]) == 0
  record = json.loads((tmp_path / "run" / rundir.RECORD_NAME).read_text())
  assert record["dataset"] == f"{loader}:load"
  with flagsaver.flagsaver(**{**TINY, "epochs": 2}, dataset="loader.py:load",
                           model_dir="../run"):
    assert train.main(["train"]) == 0  # The same file: a resume.
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  with flagsaver.flagsaver(model_path=[str(tmp_path / "run")]):
    assert predict.main(["predict"]) == 0
  assert re.search(r"predicted\s+40 rows", capsys.readouterr().out)
  assert f"dataset='{loader}:load' (data_path=None): from " in caplog.text
  os.remove(loader)
  with flagsaver.flagsaver(model_path=[str(tmp_path / "run")]):
    assert predict.main(["predict"]) == 1
  assert _error_line(capsys).endswith(
      f"(dataset='{loader}:load' is what "
      f"{tmp_path / 'run' / rundir.RECORD_NAME} records for this model; give "
      "--dataset (and --data_path) to predict on other rows.)")
