"""TFRecord shards (tfmgpu/datasets/tfrecord.py): the round trip of registry
datasets, atomic writes, per-worker sharding (two InputContexts, no cluster), the
order and its resume point, evaluation input, and errors. The CLI run (the
README's `scripts/write_tfrecords.py` + 5 epochs of `tfmgpu.train`, to >= 0.93)
is tests/test_readme_blocks.py's `test_readme_command_runs`."""

import json
import logging
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import data
from tfmgpu.datasets import tfrecord
from tfmgpu.config import TrainConfig


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory, digits_arrays):
  """The digits written as 8 shards per split (read-only for the tests)."""
  directory = tmp_path_factory.mktemp("tfr") / "digits"
  tfrecord.write_shards(digits_arrays, str(directory), num_shards=8)
  return directory


@pytest.fixture(scope="module")
def source(digits_dir):
  return data.open_dataset("tfrecord", path=f"{digits_dir}/*.tfrecord")


def small_arrays(n_train=40, n_test=12, shape=(3,)) -> data.Arrays:
  """Rows whose first feature is their index: easy to tell apart."""
  def rows(n, start):
    x = np.zeros((n, *shape), np.float32)
    x.reshape(n, -1)[:, 0] = np.arange(start, start + n)
    return x, (np.arange(n) % 3).astype(np.int32)
  (x_train, y_train), (x_test, y_test) = rows(n_train, 0), rows(n_test, 1000)
  return data.Arrays("small", x_train, y_train, x_test, y_test, 3)


def ids(batches) -> list[int]:
  """The row ids (first feature) of `(x, y)` batches, in order."""
  return [int(v) for x, _ in batches
          for v in x.numpy().reshape(len(x), -1)[:, 0]]


def contexts(num_pipelines: int, num_replicas: int):
  return [tf.distribute.InputContext(num_pipelines, i, num_replicas)
          for i in range(num_pipelines)]


# ------------------------------------------------------------- round trip

def test_digits_round_trip_exactly(source, digits_arrays, digits_dir):
  assert isinstance(source, tfrecord.TFRecordSource)
  assert data.dataset_entry("tfrecord").streamed
  assert (source.input_shape, source.num_classes) == ((28, 28, 1), 10)
  back = data.load_dataset("tfrecord", path=f"{digits_dir}/*.tfrecord")
  for name in ("x_train", "y_train", "x_test", "y_test"):
    a, b = getattr(digits_arrays, name), getattr(back, name)
    assert a.dtype == b.dtype and a.shape == b.shape, name
    np.testing.assert_array_equal(a, b, err_msg=name)
  meta = json.loads((digits_dir / "tfrecord.json").read_text())
  assert [e["examples"] for e in meta["splits"]["train"]] == [500] * 8
  assert [e["file"] for e in meta["splits"]["test"]] == [
      f"test-0000{i}-of-00008.tfrecord" for i in range(8)]
  assert meta["features"] == {"x": {"dtype": "float32", "shape": [28, 28, 1]},
                              "y": {"dtype": "int32", "shape": []}}


@pytest.mark.parametrize("name,options", [
    ("digits8x8", {}),
    ("synthetic", {"num_examples": 50, "input_shape": (2, 5), "seed": 3})])
def test_other_registry_datasets_round_trip(tmp_path, name, options):
  arrays = data.load_dataset(name, **options)
  tfrecord.write_shards(arrays, str(tmp_path / name), num_shards=3)
  back = tfrecord.open_source(str(tmp_path / name)).to_arrays()  # A directory.
  assert (back.name, back.num_classes) == (name, arrays.num_classes)
  for part in ("x_train", "y_train", "x_test", "y_test"):
    np.testing.assert_array_equal(getattr(arrays, part), getattr(back, part))


# ------------------------------------------------------------------ writing

def test_writing_replaces_a_directory_whole_or_not_at_all(tmp_path,
                                                          monkeypatch):
  out = tmp_path / "out"
  tfrecord.write_shards(small_arrays(), str(out), num_shards=4)
  before = sorted(os.listdir(out))
  with pytest.raises(FileExistsError, match=r"exists and is not empty.*"
                     r"overwrite=True"):
    tfrecord.write_shards(small_arrays(), str(out), num_shards=2)

  def fail_on_test_split(directory, split, x, y, num_shards):
    if split == "test":
      raise OSError("disk full")
    return real_write_split(directory, split, x, y, num_shards)
  real_write_split = tfrecord._write_split
  monkeypatch.setattr(tfrecord, "_write_split", fail_on_test_split)
  with pytest.raises(OSError, match="disk full"):
    tfrecord.write_shards(small_arrays(), str(out), num_shards=2,
                          overwrite=True)
  assert sorted(os.listdir(out)) == before  # The old shards, untouched.
  monkeypatch.undo()
  tfrecord.write_shards(small_arrays(), str(out), num_shards=2, overwrite=True)
  assert sorted(os.listdir(out)) == [
      "test-00000-of-00002.tfrecord", "test-00001-of-00002.tfrecord",
      "tfrecord.json", "train-00000-of-00002.tfrecord",
      "train-00001-of-00002.tfrecord"]
  assert os.listdir(tmp_path) == ["out"]  # No partial or old copies left.
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # Not mkdtemp's 0700.


def test_more_shards_than_examples_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"num_shards=13 is more than the 12 "
                     r"test examples of 'small'.*num_shards <= 12"):
    tfrecord.write_shards(small_arrays(), str(tmp_path / "x"), num_shards=13)


def test_nested_inputs_are_refused_by_name(tmp_path):
  arrays = small_arrays()
  nested = data.Arrays("two_inputs", {"a": arrays.x_train}, arrays.y_train,
                       {"a": arrays.x_test}, arrays.y_test, 3)
  with pytest.raises(ValueError, match=r"dataset 'two_inputs' has nested "
                     r"inputs.*x_train is a dict"):
    tfrecord.write_shards(nested, str(tmp_path / "x"))


# ----------------------------------------------------------------- sharding

def test_plan_shards_by_file_when_every_pipeline_gets_one():
  split = tfrecord.Split(tuple(f"f{i}" for i in range(5)), (10, 10, 10, 10, 9))
  plans = [tfrecord.plan_shards(split, 2, i) for i in range(2)]
  assert [p.by for p in plans] == ["file", "file"]
  assert [p.files for p in plans] == [("f0", "f2", "f4"), ("f1", "f3")]
  assert [p.examples for p in plans] == [29, 20]
  three = [tfrecord.plan_shards(split, 6, i) for i in range(6)]
  assert {p.by for p in three} == {"data"}
  assert [p.examples for p in three] == [9, 8, 8, 8, 8, 8]  # 49 records.
  assert tfrecord.plan_shards(split, 1, 0).by == "none"
  with pytest.raises(ValueError, match=r"pipeline_id=2 must be in 0..1"):
    tfrecord.plan_shards(split, 2, 2)


def test_two_workers_read_disjoint_files(source, caplog):
  """Two input pipelines (workers), 2 replicas each: by file, disjoint."""
  stream = source.train_dataset_fn(64)
  ctxs = contexts(2, 4)
  plans = [stream.plan(c) for c in ctxs]
  assert [p.by for p in plans] == ["file", "file"]
  assert not set(plans[0].files) & set(plans[1].files)
  assert sorted(plans[0].files + plans[1].files) == sorted(source.train.files)
  with caplog.at_level(logging.INFO):
    datasets = [stream(c) for c in ctxs]
  logged = re.findall(r"Input pipeline (\d) of 2 reads 4 of 8 files \(sharded "
                      r"by file\), 2000 examples per epoch: (.*)\.", caplog.text)
  assert [(i, names.split(", ")) for i, names in logged] == [
      (str(i), [os.path.basename(f) for f in p.files])
      for i, p in enumerate(plans)]
  # One data epoch of each worker: 2000 examples each, no example in both.
  rows = []
  for ds in datasets:
    assert ds.element_spec[0].shape == (16, 28, 28, 1)  # 64 / 4 replicas.
    x = np.concatenate([x for x, _ in ds.take(2000 // 16)])
    rows.append({r.tobytes() for r in x})
    assert len(rows[-1]) == len(x)  # Each example once in its epoch.
  assert not rows[0] & rows[1]


def test_fewer_files_than_workers_shard_by_data(tmp_path, caplog):
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=1)
  stream = tfrecord.open_source(str(tmp_path / "s")).train_dataset_fn(4)
  with caplog.at_level(logging.INFO):
    # One data epoch of each: 20 rows, in batches of 4 / 2 replicas.
    epoch = [ids(stream(c).take(20 // 2)) for c in contexts(2, 2)]
  assert "reads 1 of 1 files (sharded by data: 1 record in 2)" in caplog.text
  assert not set(epoch[0]) & set(epoch[1])
  assert sorted(epoch[0] + epoch[1]) == list(range(40))


def test_parameter_server_workers_each_read_everything(source):
  stream = source.train_dataset_fn(64, independent_workers=True)
  ctx = tf.distribute.InputContext(1, 0, 1)
  assert stream.plan(ctx).files == source.train.files
  first = [y.numpy() for _, y in stream(ctx).take(3)]
  second = [y.numpy() for _, y in stream(ctx).take(3)]
  assert any(not np.array_equal(a, b) for a, b in zip(first, second))


# -------------------------------------------------------- order and resume

def test_the_order_is_fixed_by_the_seed_and_reshuffled_each_epoch(tmp_path):
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=4)
  path = str(tmp_path / "s")
  stream = tfrecord.open_source(path, seed=1).train_dataset_fn(8)
  order = ids(stream(None).take(10))  # Two data epochs of 40 rows.
  tf.random.set_seed(1234)  # TF's global seed plays no part.
  assert ids(stream(None).take(10)) == order
  assert sorted(order[:40]) == sorted(order[40:]) == list(range(40))
  assert order[:40] != order[40:] and order[:40] != list(range(40))
  other = tfrecord.open_source(path, seed=2).train_dataset_fn(8)
  assert ids(other(None).take(5)) != order[:40]


@pytest.mark.parametrize("step", [0, 3, 5, 13])
def test_from_step_continues_at_the_same_example(tmp_path, step):
  """2 pipelines of 2 replicas: a step takes 2 batches from each pipeline;
  40 rows, 20 per pipeline, 2 per batch: data epochs end every 5 steps."""
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=4)
  stream = tfrecord.open_source(str(tmp_path / "s")).train_dataset_fn(8)
  for ctx in contexts(2, 4):
    uninterrupted = ids(stream(ctx).take(2 * 20))
    resumed = ids(stream.from_step(step)(ctx).take(2 * (20 - step)))
    assert resumed == uninterrupted[step * 2 * 2:]
  with pytest.raises(ValueError, match=r"step=-1 must be >= 0"):
    stream.from_step(-1)


def _train(strategy, stream, model_dir, epochs):
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
  trainer = Trainer(model, strategy=strategy, optimizer="sgd",
                    learning_rate=0.1, model_dir=str(model_dir), verbose=0)
  try:
    result = trainer.fit(stream, epochs=epochs, steps_per_epoch=5)
  finally:
    trainer.close()
  return model.get_weights(), result


def test_a_resumed_run_reads_on_from_the_same_example(source, tmp_path,
                                                      cpu_devices):
  """Two epochs straight vs one epoch, then a new Trainer resuming from its
  checkpoint: the stream must continue at step 5, not start over."""
  strategy = tf.distribute.MirroredStrategy(cpu_devices[:2])
  stream = source.train_dataset_fn(32)
  straight, _ = _train(strategy, stream, tmp_path / "straight", epochs=2)
  _train(strategy, stream, tmp_path / "resumed", epochs=1)
  resumed, result = _train(strategy, stream, tmp_path / "resumed", epochs=2)
  assert (result.initial_epoch, result.steps) == (1, 5)
  for a, b in zip(straight, resumed):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------- evaluation

def test_test_dataset_gives_each_example_once(tmp_path):
  tfrecord.write_shards(small_arrays(n_test=15), str(tmp_path / "s"),
                        num_shards=2)
  fn = tfrecord.open_source(str(tmp_path / "s")).test_dataset_fn(4)
  per_worker = [list(fn(c)) for c in contexts(2, 2)]
  seen = [ids(batches) for batches in per_worker]
  assert sorted(seen[0] + seen[1]) == list(range(1000, 1015))
  assert [len(x) for x, _ in per_worker[0]] == [2, 2, 2, 2]
  assert [len(x) for x, _ in per_worker[1]] == [2, 2, 2, 1]  # Partial.


def test_steps_per_epoch_and_element_spec(source):
  assert source.steps_per_epoch(64) == 4000 // 64
  x, y = source.train_dataset_fn(64).element_spec(num_replicas=2)
  assert (x.shape, x.dtype, y.shape, y.dtype) == (
      (32, 28, 28, 1), tf.float32, (32,), tf.int32)
  with pytest.raises(ValueError, match=r"global_batch_size=8000 is larger "
                     r"than the 4000 training examples"):
    source.steps_per_epoch(8000)


# ------------------------------------------------------------------- errors

def test_errors_name_the_path_and_the_fix(tmp_path, digits_dir):
  with pytest.raises(ValueError, match=r"dataset='tfrecord' needs data_path="):
    TrainConfig(dataset="tfrecord")
  with pytest.raises(ValueError, match=r"needs path='DIR/\*.tfrecord'.*"
                     r"write_tfrecords.py"):
    data.open_dataset("tfrecord")
  with pytest.raises(FileNotFoundError, match=r"matches no files.*quote it"):
    tfrecord.open_source(f"{tmp_path}/*.tfrecord")
  bare = tmp_path / "bare"
  bare.mkdir()
  (bare / "a.tfrecord").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"tfrecord.json is missing: it "
                     r"holds the shapes"):
    tfrecord.open_source(str(bare))
  with pytest.raises(ValueError, match=r"matches no training shard"):
    tfrecord.open_source(f"{digits_dir}/test-*.tfrecord")
  train_only = tfrecord.open_source(f"{digits_dir}/train-*.tfrecord")
  with pytest.raises(ValueError, match=r"matched no test shard.*match the "
                     r"test shards too"):
    train_only.test_dataset_fn(64)
  (bare / "tfrecord.json").write_text(json.dumps({"format": "tfmgpu.tfrecord",
                                                  "version": 99}))
  with pytest.raises(ValueError, match=r"version=99; this tfmgpu reads "
                     r"version 1"):
    tfrecord.open_source(str(bare))


def test_files_the_sidecar_does_not_list_are_refused(tmp_path):
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=2)
  (tmp_path / "s" / "extra.tfrecord").write_bytes(b"")
  with pytest.raises(ValueError, match=r"matches files that .*tfrecord.json "
                     r"does not list: extra.tfrecord"):
    tfrecord.open_source(str(tmp_path / "s"))


# ------------------------------------------------------------------- CLI

@pytest.mark.slow
# ----------------------------------------------------------- damaged shards

def _damage(path, how: str, records: int) -> None:
  """Damages a shard of `records` records of one size (issue 29 item 1)."""
  data = path.read_bytes()
  record = len(data) // records
  if how == "deleted":
    path.unlink()
  elif how == "emptied":
    path.write_bytes(b"")
  elif how == "cut at a record boundary":
    path.write_bytes(data[:len(data) - record])
  elif how == "cut mid-record":
    path.write_bytes(data[:len(data) - record // 2])
  else:  # Flipped bytes: the same size, a bad checksum.
    middle = len(data) // 2
    path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[
        middle:middle + 4]) + data[middle + 4:])


@pytest.mark.parametrize("how", ["deleted", "emptied", "cut at a record "
                                 "boundary", "cut mid-record"])
def test_a_missing_or_cut_shard_is_named_before_reading(tmp_path, how, caplog):
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=4)
  shard = tmp_path / "s" / "train-00001-of-00004.tfrecord"
  _damage(shard, how, records=10)
  for skip, offer in ((None, False), (False, True)):
    with pytest.raises(tfrecord.DamagedShardError) as damaged:
      tfrecord.open_source(f"{tmp_path}/s/*.tfrecord", skip_damaged_shards=skip)
    message = str(damaged.value)
    assert message.startswith(f"TFRecord shard {shard} is damaged: it is ")
    assert "write_tfrecords.py" in message
    assert ("--skip_damaged_shards" in message) == offer
  source = tfrecord.open_source(str(tmp_path / "s"), skip_damaged_shards=True)
  assert [os.path.basename(f) for f in source.train.files] == [
      "train-00000-of-00004.tfrecord", "train-00002-of-00004.tfrecord",
      "train-00003-of-00004.tfrecord"]
  assert source.train.num_examples == 30
  assert f"Skipping damaged TFRecord shard {shard}" in caplog.text
  assert "30 examples" in caplog.text
  # A glob that does not ask for the shard does not see it.
  tfrecord.open_source(f"{tmp_path}/s/*-0000[023]-of-*.tfrecord")


def test_flipped_bytes_are_found_by_reading_and_named(tmp_path):
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=4)
  shard = tmp_path / "s" / "train-00002-of-00004.tfrecord"
  _damage(shard, "flipped", records=10)
  source = tfrecord.open_source(str(tmp_path / "s"))  # The size is right.
  with pytest.raises(tfrecord.DamagedShardError, match=(
      rf"shard {re.escape(str(shard))} is damaged: the record at byte \d+ "
      r"is corrupted \(DataLossError")):
    source.to_arrays()
  explained = source.explain_read_error(tf.errors.DataLossError(None, None, "x"))
  assert isinstance(explained, tfrecord.DamagedShardError)
  assert explained.path == str(shard) and "--skip_damaged_shards" in str(
      explained)
  skipped = tfrecord.open_source(str(tmp_path / "s"), skip_damaged_shards=True)
  assert str(shard) not in skipped.train.files
  assert skipped.to_arrays().x_train.shape[0] == 30


def test_an_old_sidecar_without_sizes_is_checked_by_counting(tmp_path):
  """Shards written before the sidecar listed sizes: reading counts."""
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=2)
  sidecar = tmp_path / "s" / "tfrecord.json"
  meta = json.loads(sidecar.read_text())
  for entries in meta["splits"].values():
    for entry in entries:
      del entry["bytes"]
  sidecar.write_text(json.dumps(meta))
  shard = tmp_path / "s" / "test-00001-of-00002.tfrecord"
  _damage(shard, "cut at a record boundary", records=6)
  with pytest.raises(tfrecord.DamagedShardError, match=(
      rf"{re.escape(str(shard))} is damaged: it holds 5 records, "
      r"tfrecord.json lists 6")):
    tfrecord.open_source(str(tmp_path / "s")).to_arrays()


def test_a_shard_cut_after_the_start_up_check_is_not_read_short(tmp_path):
  """Cut (or a record appended) after `open_source` checked its size, as
  while a run trains: each pass counts the records against the sidecar, in
  the training stream (per shard) and in evaluation, and the error names
  the shard (the stream read it short, with no warning)."""
  tfrecord.write_shards(small_arrays(), str(tmp_path / "s"), num_shards=4)
  source = tfrecord.open_source(str(tmp_path / "s"))
  for split, records, how in (("train", 10, "cut"), ("test", 3, "grown")):
    shard = tmp_path / "s" / f"{split}-00001-of-00004.tfrecord"
    intact = shard.read_bytes()
    if how == "grown":
      shard.write_bytes(intact + intact[:len(intact) // records])
    else:
      _damage(shard, "cut at a record boundary", records=records)
    fn = (source.train_dataset_fn(4) if split == "train"
          else source.test_dataset_fn(4))
    with pytest.raises(tf.errors.FailedPreconditionError) as short:
      list(fn(None).take(20))  # Two data epochs of 40 rows (test: 12).
    explained = source.explain_read_error(short.value)
    assert isinstance(explained, tfrecord.DamagedShardError)
    assert str(explained).startswith(
        f"TFRecord shard {shard} is damaged: it holds "
        f"{records + (1 if how == 'grown' else -1)} records, tfrecord.json "
        f"lists {records}: it was cut or changed.")
    shard.write_bytes(intact)
  assert len(list(source.train_dataset_fn(4)(None).take(20))) == 20
  for other in (tf.errors.FailedPreconditionError(None, None, "other"),
                tf.errors.NotFoundError(None, None, "No OpKernel ...")):
    assert source.explain_read_error(other) is other  # Not a shard's.
