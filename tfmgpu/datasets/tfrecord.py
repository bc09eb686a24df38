"""TFRecord shards: write any registry dataset, stream it back per worker.

The format (`write_shards` writes it, `open_source` reads it):

* `DIR/train-00000-of-00008.tfrecord`, ..., `DIR/test-00007-of-00008.tfrecord`:
  one `tf.train.Example` per example, with two bytes features, `x` (the
  features) and `y` (the label), each the raw little-endian bytes of one
  array.
* `DIR/tfrecord.json`, the sidecar: dtype and shape of `x` and `y`, the
  number of classes, and for each split its files with their example
  counts and sizes in bytes. Shapes live here, not in every record: static shapes for the
  model and the batches, and `steps_per_epoch` without a counting pass.

A `TFRecordSource` turns a glob of such files into dataset functions
(`fn(input_context) -> tf.data.Dataset` of per-replica batches) that
`tf.distribute.Strategy.distribute_datasets_from_function` calls once per
input pipeline (one per worker):

* Sharding: with at least as many files as input pipelines, each pipeline
  reads its own files (`files[id::n]`, "by file"); with fewer, every
  pipeline reads every file and keeps every n-th record ("by data"). The
  choice and the files are logged. `ParameterServerStrategy` gives a
  dataset function no worker index (its `InputContext` says one pipeline),
  so there each worker reads every file in its own random order
  (`independent_workers=True`).
* Order: the training stream is endless; data epoch `e` reads the files in
  an order fixed by `(seed, e)`, interleaved, through a shuffle buffer
  seeded by `(seed, e)`. The same seed, worker count and batch size give
  the same batches, in every process.
* Resume: TensorFlow 2.21 cannot checkpoint a distributed iterator
  (`tf.train.Checkpoint` rejects `DistributedIterator`), so a resumed run
  restarts the stream at the global step its checkpoint holds:
  `TrainStream.from_step(step)` starts at the data epoch that step falls in
  and skips the records before it (re-reading at most one epoch of this
  worker's records). The rerun sees exactly the examples an uninterrupted
  run would have seen from that step on.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable

from absl import logging
import numpy as np

from tfmgpu import checks
from tfmgpu.datasets import registry as data_lib
from tfmgpu import files
from tfmgpu._lazy import LazyModule

tf = LazyModule("tensorflow")

SIDECAR = "tfrecord.json"
FORMAT = "tfmgpu.tfrecord"
VERSION = 1
SPLITS = ("train", "test")
DEFAULT_SHUFFLE_BUFFER = 10_000
_MAX_EPOCHS = 2**62  # "Endless" for the training stream.


def shard_name(split: str, index: int, num_shards: int) -> str:
  """`train-00003-of-00008.tfrecord`."""
  return f"{split}-{index:05d}-of-{num_shards:05d}.tfrecord"


# ------------------------------------------------------------------- writing

def write_shards(arrays: data_lib.Arrays, directory: str, *,
                 num_shards: int = 8, overwrite: bool = False) -> str:
  """Writes `arrays` (both splits) as TFRecord shards plus the sidecar.

  Everything is written into a new sibling directory first and renamed into
  place at the end, so `directory` holds either the previous shards or all
  of the new ones, never a mix or a torn file.

  Args:
    arrays: a loaded registry dataset (`tfmgpu.data.load_dataset(...)`).
    directory: where the shards go.
    num_shards: shards per split; each split needs at least this many
      examples. Shards differ in size by at most one example.
    overwrite: replace an existing non-empty `directory`.

  Returns:
    The sidecar's path (`directory/tfrecord.json`).

  Raises:
    ValueError: `num_shards` < 1 or larger than a split.
    FileExistsError: `directory` is not empty and `overwrite` is false.
  """
  _check_writable(arrays, num_shards)
  directory = os.path.abspath(directory)
  if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
    raise FileExistsError(
        f"directory={directory!r} exists and is not empty. Pass overwrite="
        "True (--overwrite) to replace it, or choose a new directory.")
  parent, base = os.path.split(directory)
  os.makedirs(parent, exist_ok=True)
  partial = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(partial, 0o777 & ~umask)  # mkdtemp's 0700 would hide the shards.
  try:
    splits = {split: _write_split(partial, split, x, y, num_shards)
              for split, x, y in (("train", arrays.x_train, arrays.y_train),
                                  ("test", arrays.x_test, arrays.y_test))}
    meta = _sidecar(arrays, splits)
    with open(os.path.join(partial, SIDECAR), "w") as f:
      json.dump(meta, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    files.fsync_directory(partial)
    _swap_in(partial, directory)
  finally:
    if os.path.exists(partial):
      shutil.rmtree(partial)
  return os.path.join(directory, SIDECAR)


def _check_writable(arrays: data_lib.Arrays, num_shards: int) -> None:
  """One array per split, and at least one example per shard."""
  checks.check_positive("num_shards", num_shards)
  if not all(isinstance(a, np.ndarray) for a in (
      arrays.x_train, arrays.y_train, arrays.x_test, arrays.y_test)):
    raise ValueError(
        f"dataset {arrays.name!r} has nested inputs or targets (e.g. a dict "
        f"of arrays: x_train is a {type(arrays.x_train).__name__}); TFRecord "
        "shards hold one feature array and one label array per example. "
        "Write a single array per split, or keep this dataset in memory.")
  for split, y in (("train", arrays.y_train), ("test", arrays.y_test)):
    if len(y) < num_shards:
      raise ValueError(f"num_shards={num_shards} is more than the {len(y)} "
                       f"{split} examples of {arrays.name!r}: every shard "
                       f"would not get one. Use num_shards <= {len(y)}.")


def _sidecar(arrays: data_lib.Arrays,
             splits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
  def spec(a: np.ndarray) -> dict[str, Any]:
    return {"dtype": a.dtype.name, "shape": list(a.shape[1:])}
  return {"format": FORMAT, "version": VERSION, "name": arrays.name,
          "num_classes": int(arrays.num_classes),
          "features": {"x": spec(arrays.x_train), "y": spec(arrays.y_train)},
          "splits": splits}


def _write_split(directory: str, split: str, x: np.ndarray, y: np.ndarray,
                 num_shards: int) -> list[dict[str, Any]]:
  """Writes contiguous blocks of `(x, y)` as shards; returns their entries."""
  entries = []
  for i, rows in enumerate(np.array_split(np.arange(len(x)), num_shards)):
    name = shard_name(split, i, num_shards)
    path = os.path.join(directory, name)
    with tf.io.TFRecordWriter(path) as writer:
      for r in rows:
        writer.write(serialize_example(x[r], y[r]))
    with open(path, "rb") as f:
      os.fsync(f.fileno())
    entries.append({"file": name, "examples": int(len(rows)),
                    "bytes": os.path.getsize(path)})
  return entries


def serialize_example(x: np.ndarray, y: np.ndarray) -> bytes:
  """One `tf.train.Example` with the raw little-endian bytes of `x` and `y`."""
  def raw(a: np.ndarray):
    a = np.asarray(a)
    data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
  return tf.train.Example(features=tf.train.Features(
      feature={"x": raw(x), "y": raw(y)})).SerializeToString()


def _swap_in(partial: str, directory: str) -> None:
  """Renames `partial` to `directory`, moving an existing one aside first."""
  old = None
  if os.path.exists(directory):
    parent, base = os.path.split(directory)
    old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
    os.rename(directory, os.path.join(old, base))
  os.rename(partial, directory)
  files.fsync_directory(os.path.dirname(directory))
  if old:
    shutil.rmtree(old)


# ------------------------------------------------------------------ damage

SKIP_HINT = ("or train without it: --skip_damaged_shards "
             "(TFRecordSource(skip_damaged_shards=True))")


class DamagedShardError(ValueError):
  """A TFRecord shard is missing, shorter than its sidecar says, or fails
  its checksums. The message names the file and what to do.

  Attributes:
    path: the shard.
  """

  def __init__(self, path: str, why: str, *, offer_skip: bool = False):
    self.path, self.why = path, why
    fix = ("Restore it, or rewrite the shards with python "
           "scripts/write_tfrecords.py")
    super().__init__(f"TFRecord shard {path} is damaged: {why}. {fix}"
                     + (f"; {SKIP_HINT}." if offer_skip else "."))


def _size_problem(path: str, entry: dict[str, Any]) -> str | None:
  """Why `path` cannot be the shard `entry` lists, from its size alone."""
  if not os.path.exists(path):
    return _missing(entry["examples"])
  size, listed = os.path.getsize(path), entry.get("bytes")
  if listed is not None and size != listed:
    return (f"it is {size} bytes, {SIDECAR} lists {listed} bytes "
            f"({entry['examples']} examples): it was cut or changed")
  if size == 0 and entry["examples"]:
    return f"it is empty ({SIDECAR} lists {entry['examples']} examples)"
  return None


def _missing(examples: int) -> str:
  return f"it is missing ({SIDECAR} lists it with {examples} examples)"


def _data_loss_why(error: Exception) -> str:
  where = re.search(r"(corrupted|truncated) record at (\d+)", str(error))
  what = (f"the record at byte {where.group(2)} is {where.group(1)}" if where
          else "a record is damaged")
  return (f"{what} ({type(error).__name__}: the file was cut or its bytes "
          "changed)")


def _count_problem(count: int, expected: int) -> str | None:
  if count == expected:
    return None
  return (f"it holds {count} records, {SIDECAR} lists {expected}: it was cut "
          "or changed")


# TF's words when a shard read through `_shard_records` held another number
# of records than the sidecar lists.
_COUNT_MISMATCH = re.compile(r"expected to contain \d+ elements but "
                             r"contained")


def _shard_records(path, expected) -> "tf.data.Dataset":
  """The `expected` records of the shard(s) `path` (tensors or Python
  values), counted as they are read: a shard cut or grown after
  `open_source` checked its size fails with a `FailedPreconditionError`
  at its end, instead of being read short (a counter: reading the digits'
  shards took the same CPU time with it, within 5%)."""
  return tf.data.TFRecordDataset(path).apply(
      tf.data.experimental.assert_cardinality(tf.cast(expected, tf.int64)))


def _is_read_error(error: Exception, paths: list[str]) -> bool:
  """Whether `error` may come from one of the shards `paths` damaged while
  it was read: a failed checksum, another number of records than the
  sidecar lists, or a shard deleted (TF names it)."""
  if isinstance(error, tf.errors.NotFoundError):
    return any(p in str(error) for p in paths)
  return isinstance(error, tf.errors.DataLossError) or (
      isinstance(error, tf.errors.FailedPreconditionError)
      and _COUNT_MISMATCH.search(str(error)) is not None)


def scan_shard(path: str, expected: int) -> str | None:
  """Reads every record of `path` (checksums included); why it is damaged,
  or `None` when it holds `expected` intact records."""
  count = 0
  try:
    for batch in tf.data.TFRecordDataset(path).batch(4096):
      count += int(batch.shape[0])
  except tf.errors.DataLossError as e:
    return _data_loss_why(e)
  except tf.errors.NotFoundError:
    return _missing(expected)
  return _count_problem(count, expected)


# ------------------------------------------------------------------- reading

@dataclasses.dataclass(frozen=True)
class Split:
  """The files of one split that a glob matched, with their example counts."""
  files: tuple[str, ...]
  counts: tuple[int, ...]

  @property
  def num_examples(self) -> int:
    return sum(self.counts)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """What one input pipeline reads.

  Attributes:
    files: the files it reads.
    by: `"file"` (its own files), `"data"` (every n-th record of all files)
      or `"none"` (one pipeline reads everything).
    num_pipelines, pipeline_id: its place among the input pipelines.
    examples: examples it reads per data epoch.
  """
  files: tuple[str, ...]
  by: str
  num_pipelines: int
  pipeline_id: int
  examples: int

  def describe(self, total_files: int, max_names: int = 16) -> str:
    names = ", ".join(os.path.basename(f) for f in self.files[:max_names])
    if len(self.files) > max_names:
      names += f", ... ({len(self.files) - max_names} more)"
    how = {"file": "sharded by file", "data": "sharded by data: 1 record in "
           f"{self.num_pipelines}", "none": "not sharded"}[self.by]
    return (f"Input pipeline {self.pipeline_id} of {self.num_pipelines} reads "
            f"{len(self.files)} of {total_files} files ({how}), "
            f"{self.examples} examples per epoch: {names}")


def plan_shards(split: Split, num_pipelines: int, pipeline_id: int
                ) -> ShardPlan:
  """By file when every pipeline gets a file, else by data.

  Raises:
    ValueError: `pipeline_id` outside `0..num_pipelines - 1`.
  """
  checks.check_positive("num_pipelines", num_pipelines)
  if not 0 <= pipeline_id < num_pipelines:
    raise ValueError(f"pipeline_id={pipeline_id} must be in 0.."
                     f"{num_pipelines - 1} (num_pipelines={num_pipelines}).")
  if num_pipelines == 1:
    return ShardPlan(split.files, "none", 1, 0, split.num_examples)
  if len(split.files) >= num_pipelines:
    return ShardPlan(split.files[pipeline_id::num_pipelines], "file",
                     num_pipelines, pipeline_id,
                     sum(split.counts[pipeline_id::num_pipelines]))
  return ShardPlan(split.files, "data", num_pipelines, pipeline_id,
                   len(range(pipeline_id, split.num_examples, num_pipelines)))


def _context(ctx) -> tuple[int, int, int]:
  """`(num_pipelines, pipeline_id, replicas per pipeline)`; `None`: one of each."""
  if ctx is None:
    return 1, 0, 1
  return (ctx.num_input_pipelines, ctx.input_pipeline_id,
          max(ctx.num_replicas_in_sync // ctx.num_input_pipelines, 1))


def _with_options(ds: "tf.data.Dataset") -> "tf.data.Dataset":
  """Sharded here, so TF's auto-sharding is off; the order is deterministic."""
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  options.deterministic = True
  return ds.with_options(options)


def _per_replica_batch(ctx, global_batch_size: int) -> int:
  if ctx is None:
    return global_batch_size
  return ctx.get_per_replica_batch_size(global_batch_size)


class TFRecordSource:
  """TFRecord shards matched by a glob: a dataset that is streamed, not loaded.

  Made by `open_source` (or `tfmgpu.data.open_dataset("tfrecord",
  path=...)`). It gives what a run needs: the example shape and class count
  (to build the model), `steps_per_epoch`, and dataset functions for
  training (`train_dataset_fn`, endless) and evaluation (`test_dataset_fn`,
  each test example once).

  Attributes:
    name: the dataset the shards were written from (e.g. `"digits"`).
    train, test: the matched files of each split.
    x_spec, y_spec: `(dtype name, shape)` of one example's features / label.
    num_classes: label values.
    seed: fixes the training order.
    shuffle_buffer: records in each input pipeline's shuffle buffer.
  """

  def __init__(self, *, name: str, train: Split, test: Split,
               x_spec: tuple[str, tuple[int, ...]],
               y_spec: tuple[str, tuple[int, ...]], num_classes: int,
               seed: int = 0, shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER):
    checks.check_positive("shuffle_buffer", shuffle_buffer)
    self.name, self.train, self.test = name, train, test
    self.x_spec, self.y_spec = x_spec, y_spec
    self.num_classes, self.seed = num_classes, seed
    self.shuffle_buffer = shuffle_buffer

  @property
  def input_shape(self) -> tuple[int, ...]:
    """Shape of one example's features, e.g. `(28, 28, 1)`."""
    return self.x_spec[1]

  def __repr__(self) -> str:
    return (f"TFRecordSource({self.name!r}: train {self.train.num_examples} "
            f"examples in {len(self.train.files)} files, test "
            f"{self.test.num_examples} in {len(self.test.files)}, example "
            f"{self.x_spec[0]}{list(self.input_shape)}, {self.num_classes} "
            "classes)")

  def element_spec(self, batch: int | None = None) -> tuple[Any, Any]:
    """`(x, y)` `tf.TensorSpec`s of batches of `batch` examples."""
    return tuple(tf.TensorSpec((batch, *shape), tf.as_dtype(dtype))
                 for dtype, shape in (self.x_spec, self.y_spec))

  def steps_per_epoch(self, global_batch_size: int) -> int:
    """Global batches in one pass over the training examples.

    Raises:
      ValueError: fewer training examples than one global batch.
    """
    checks.check_positive("global_batch_size", global_batch_size)
    steps = self.train.num_examples // global_batch_size
    if steps < 1:
      raise ValueError(
          f"global_batch_size={global_batch_size} is larger than the "
          f"{self.train.num_examples} training examples of the TFRecord "
          "shards; use a smaller batch.")
    return steps

  def train_dataset_fn(self, global_batch_size: int, *,
                       independent_workers: bool = False) -> "TrainStream":
    """The endless training stream, as a dataset function (see `TrainStream`).

    Args:
      global_batch_size: examples per step over all replicas.
      independent_workers: every worker reads every file in its own random
        order (parameter-server training, whose dataset functions get no
        worker index); the order is then not reproducible.
    """
    checks.check_positive("global_batch_size", global_batch_size)
    return TrainStream(self, global_batch_size,
                       independent_workers=independent_workers)

  def test_dataset_fn(self, global_batch_size: int
                      ) -> Callable[[Any], "tf.data.Dataset"]:
    """Each test example once, in file order, sharded by data.

    Per-replica batches; the last one may be partial (or empty for some
    pipelines), so the consumer must handle partial batches.

    Raises:
      ValueError: the glob matched no test shard.
    """
    checks.check_positive("global_batch_size", global_batch_size)
    if not self.test.files:
      raise ValueError(
          "The TFRecord glob matched no test shard (test-*.tfrecord), so "
          "there is nothing to evaluate on: match the test shards too, e.g. "
          "'DIR/*.tfrecord'.")

    def dataset_fn(ctx=None) -> "tf.data.Dataset":
      n, i, _ = _context(ctx)
      # Counted whole (a per-file count, by flat_map, read 1.6x slower):
      # the damaged file is found by `explain_read_error`.
      ds = _shard_records(list(self.test.files), self.test.num_examples)
      if n > 1:
        ds = ds.shard(n, i)
      ds = ds.batch(_per_replica_batch(ctx, global_batch_size))
      return _with_options(ds.map(self.parse).prefetch(tf.data.AUTOTUNE))
    return dataset_fn

  def parse(self, serialized: "tf.Tensor") -> tuple["tf.Tensor", "tf.Tensor"]:
    """A batch of serialized examples -> `(x, y)` with static shapes."""
    features = tf.io.parse_example(serialized, {
        k: tf.io.FixedLenFeature([], tf.string) for k in ("x", "y")})
    batch = serialized.shape[0] if serialized.shape[0] is not None else -1
    return tuple(
        tf.reshape(tf.io.decode_raw(features[k], tf.as_dtype(dtype)),
                   [batch, *shape])
        for k, (dtype, shape) in (("x", self.x_spec), ("y", self.y_spec)))

  def epoch_records(self, plan: ShardPlan, epoch, seed) -> "tf.data.Dataset":
    """Serialized records of one data epoch of `plan`, in the order of
    `(seed, epoch)` (int64 scalars, Python or tensors)."""
    seeds = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    order = tf.random.experimental.stateless_shuffle(
        tf.range(len(plan.files)), seed=seeds)
    files = tf.gather(tf.constant(plan.files), order)
    counts = tf.gather(tf.constant(self._counts_of(plan.files), tf.int64),
                       order)
    ds = tf.data.Dataset.from_tensor_slices((files, counts)).interleave(
        _shard_records, cycle_length=min(len(plan.files), 4),
        block_length=1, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True)
    if plan.by == "data":
      ds = ds.shard(plan.num_pipelines, plan.pipeline_id)
    # A stateless shuffle of each block of `shuffle_buffer` records: unlike
    # `Dataset.shuffle`, its order does not depend on TF's global seed.
    blocks = ds.batch(min(self.shuffle_buffer, plan.examples)).enumerate()
    return blocks.map(lambda i, block: tf.random.experimental.stateless_shuffle(
        block, seed=tf.stack([seeds[0], seeds[1] * 1_000_003 + i]))).unbatch()

  def _counts_of(self, paths: tuple[str, ...]) -> tuple[int, ...]:
    """The records the sidecar lists for each of `paths`."""
    listed = {path: count for part in (self.train, self.test)
              for path, count in zip(part.files, part.counts)}
    return tuple(listed[p] for p in paths)

  def read_split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All examples of `split` (`"train"` or `"test"`) in file order, in memory.

    Raises:
      DamagedShardError: a file fails its checksums or holds another number
        of records than the sidecar lists.
    """
    checks.check_choice("split", split, SPLITS)
    part = getattr(self, split)
    xs, ys = [np.zeros((0, *self.input_shape), self.x_spec[0])], [
        np.zeros((0, *self.y_spec[1]), self.y_spec[0])]
    for path, expected in zip(part.files, part.counts):
      count = 0
      try:
        for x, y in tf.data.TFRecordDataset(path).batch(4096).map(self.parse):
          xs.append(x.numpy())
          ys.append(y.numpy())
          count += len(y)
      except tf.errors.DataLossError as e:
        raise DamagedShardError(path, _data_loss_why(e)) from None
      problem = _count_problem(count, expected)
      if problem:
        raise DamagedShardError(path, problem)
    return np.concatenate(xs), np.concatenate(ys)

  def explain_read_error(self, error: Exception) -> Exception:
    """A `DataLossError` of training or evaluation, a shard that held
    another number of records than the sidecar lists, or one deleted
    (`_is_read_error`), as the damaged shard: reads each file through to
    find it (`error` itself if none is, or for other errors)."""
    if not _is_read_error(error, [*self.train.files, *self.test.files]):
      return error
    for part in (self.train, self.test):
      for path, expected in zip(part.files, part.counts):
        why = scan_shard(path, expected)
        if why:
          return DamagedShardError(path, why, offer_skip=True)
    return error

  def to_arrays(self) -> data_lib.Arrays:
    """Both splits read into memory (`data.load_dataset("tfrecord", ...)`)."""
    (x_train, y_train), (x_test, y_test) = (self.read_split(s) for s in SPLITS)
    return data_lib.Arrays(self.name, x_train, y_train, x_test, y_test,
                           self.num_classes)


@dataclasses.dataclass(frozen=True)
class TrainStream:
  """The endless training stream of a `TFRecordSource`, as a dataset function.

  Call it with a `tf.distribute.InputContext` (as
  `strategy.distribute_datasets_from_function` does) or `None` (one
  pipeline): it returns the pipeline's `tf.data.Dataset` of per-replica
  `(x, y)` batches (`drop_remainder`, static shapes), sharded as
  `plan_shards` says and logged.

  Attributes:
    source: the shards.
    global_batch_size: examples per step over all replicas.
    start_step: the global step the stream starts at (see `from_step`).
    independent_workers: see `TFRecordSource.train_dataset_fn`.
  """
  source: TFRecordSource
  global_batch_size: int
  start_step: int = 0
  independent_workers: bool = False

  def from_step(self, step: int) -> "TrainStream":
    """The same stream from global step `step` on (a resumed run).

    Each step takes one per-replica batch per replica of a pipeline, so the
    pipeline skips `step * replicas * per_replica_batch` records: whole data
    epochs by arithmetic, the rest by reading.
    """
    if step < 0:
      raise ValueError(f"step={step} must be >= 0.")
    return dataclasses.replace(self, start_step=step)

  def element_spec(self, num_replicas: int = 1) -> tuple[Any, Any]:
    """The per-replica batch specs under `num_replicas` replicas."""
    return self.source.element_spec(self.global_batch_size // num_replicas)

  def plan(self, ctx=None) -> ShardPlan:
    """What the pipeline of `ctx` reads."""
    n, i, _ = _context(ctx)
    if self.independent_workers:
      return plan_shards(self.source.train, 1, 0)
    return plan_shards(self.source.train, n, i)

  def __call__(self, ctx=None) -> "tf.data.Dataset":
    n, i, replicas = _context(ctx)
    per_replica = _per_replica_batch(ctx, self.global_batch_size)
    plan = self.plan(ctx)
    total = len(self.source.train.files)
    if self.independent_workers:
      logging.info("Each worker reads all %d training files in its own random "
                   "order (parameter-server training gives a dataset function "
                   "no worker index to shard by).", total)
      seed = tf.cast(tf.timestamp() * 1e6, tf.int64)
    else:
      # One pipeline has no choice to report (and Trainer.fit calls the
      # function once with one pipeline to learn its length).
      log = logging.info if n > 1 else logging.debug
      log("%s.", plan.describe(total))
      seed = self.source.seed
    if plan.examples < per_replica:
      raise ValueError(
          f"Input pipeline {i} of {n} reads {plan.examples} training examples "
          f"per epoch, fewer than its per-replica batch of {per_replica}. "
          "Use a smaller global_batch_size or write more examples.")
    first_epoch, skip = divmod(self.start_step * replicas * per_replica,
                               plan.examples)
    ds = tf.data.Dataset.range(first_epoch, _MAX_EPOCHS).flat_map(
        lambda epoch: self.source.epoch_records(plan, epoch, seed))
    ds = ds.skip(skip).batch(per_replica, drop_remainder=True)
    ds = ds.map(self.source.parse, num_parallel_calls=tf.data.AUTOTUNE)
    return _with_options(ds.prefetch(tf.data.AUTOTUNE))


# ------------------------------------------------------------------ opening

def open_source(path: str | None, *, seed: int = 0,
                shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
                skip_damaged_shards: bool | None = None) -> TFRecordSource:
  """The TFRecord shards matched by `path`, with their sidecar.

  Each listed shard `path` matches must exist with its listed size.

  Args:
    path: a glob (`"DIR/*.tfrecord"`, `"DIR/train-*"`) or a directory (all
      its `*.tfrecord` files). The files must be in one directory, beside
      the `tfrecord.json` that `write_shards` wrote.
    seed: fixes the training order.
    shuffle_buffer: records per input pipeline's shuffle buffer.
    skip_damaged_shards: `True`: also read every matched shard through
      (checksums included) and leave out the damaged ones, each logged.
      `False` (training): a damaged shard is an error that offers this
      option. `None` (reading, e.g. predict): an error without the offer.

  Raises:
    ValueError: no path, a sidecar that does not describe the files, or no
      training shard matched.
    DamagedShardError: a shard is missing, cut or changed.
    FileNotFoundError: nothing matched, or the sidecar is missing.
  """
  files = _matched_files(path)
  directory = os.path.dirname(files[0])
  meta = read_sidecar(directory)
  entries = {os.path.join(directory, e["file"]): e
             for split in SPLITS for e in meta["splits"].get(split, [])}
  unknown = [os.path.basename(f) for f in files if f not in entries]
  if unknown:
    raise ValueError(
        f"data_path={path!r} matches files that {directory}/{SIDECAR} does not "
        f"list: {', '.join(unknown[:5])}. Match only the shards written "
        "with it (e.g. 'DIR/*-of-*.tfrecord'), or rewrite the directory.")
  wanted = [p for p in entries if p in files or fnmatch.fnmatch(
      p, _pattern(path))]
  damaged = _damaged(wanted, entries, scan=skip_damaged_shards is True)
  if damaged and not skip_damaged_shards:
    first = next(iter(damaged))
    raise DamagedShardError(first, damaged[first],
                            offer_skip=skip_damaged_shards is False)
  splits = {split: _split_of([
      p for p in (os.path.join(directory, e["file"])
                  for e in meta["splits"].get(split, []))
      if p in wanted and p not in damaged], entries) for split in SPLITS}
  if damaged:
    _log_skipped(damaged, splits)
  if not splits["train"].files:
    raise ValueError(f"data_path={path!r} matches no training shard "
                     f"({SPLITS[0]}-*.tfrecord)"
                     + (" that is intact" if damaged else "")
                     + f"; match them too, e.g. '{directory}/*.tfrecord'.")
  features = meta["features"]
  return TFRecordSource(
      name=meta["name"], train=splits["train"], test=splits["test"],
      x_spec=(features["x"]["dtype"], tuple(features["x"]["shape"])),
      y_spec=(features["y"]["dtype"], tuple(features["y"]["shape"])),
      num_classes=int(meta["num_classes"]), seed=seed,
      shuffle_buffer=shuffle_buffer)


def _pattern(path: str) -> str:
  """The absolute glob `path` stands for (a directory: its `*.tfrecord`)."""
  return os.path.abspath(os.path.join(path, "*.tfrecord") if os.path.isdir(
      path) else path)


def _split_of(paths: list[str], entries: dict[str, dict[str, Any]]) -> Split:
  return Split(tuple(paths), tuple(entries[p]["examples"] for p in paths))


def _damaged(paths: list[str], entries: dict[str, dict[str, Any]], *,
             scan: bool) -> dict[str, str]:
  """Shard -> why it is damaged: by size; with `scan`, also by reading."""
  damaged = {}
  for p in paths:
    why = _size_problem(p, entries[p])
    if why is None and scan:
      why = scan_shard(p, entries[p]["examples"])
    if why is not None:
      damaged[p] = why
  return damaged


def _log_skipped(damaged: dict[str, str], splits: dict[str, Split]) -> None:
  for p, why in damaged.items():
    logging.warning("Skipping damaged TFRecord shard %s (--skip_damaged_shards)"
                    ": %s.", p, why)
  logging.warning("Reading %s after skipping %d damaged shard(s).", ", ".join(
      f"{len(splits[s].files)} {s} files ({splits[s].num_examples} examples)"
      for s in SPLITS), len(damaged))


def _matched_files(path: str | None) -> list[str]:
  if not path:
    raise ValueError(
        "dataset 'tfrecord' needs path='DIR/*.tfrecord' (CLI: --data_path). "
        "Write shards with: python scripts/write_tfrecords.py "
        "--dataset=digits --output_dir=DIR")
  pattern = os.path.join(path, "*.tfrecord") if os.path.isdir(path) else path
  files = sorted(os.path.abspath(f) for f in glob.glob(pattern)
                 if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(
        f"data_path={path!r} matches no files. Give a glob of TFRecord shards "
        "(quote it in a shell: --data_path='DIR/*.tfrecord'); write them with "
        "python scripts/write_tfrecords.py --dataset=digits --output_dir=DIR")
  directories = sorted({os.path.dirname(f) for f in files})
  if len(directories) > 1:
    raise ValueError(
        f"data_path={path!r} matches files in {len(directories)} directories "
        f"({', '.join(directories[:3])}); each has its own {SIDECAR}. Match "
        "the shards of one directory.")
  return files


def read_sidecar(directory: str) -> dict[str, Any]:
  """The `tfrecord.json` of `directory`, checked.

  Raises:
    FileNotFoundError: no sidecar.
    ValueError: not one this module wrote, or a newer version.
  """
  path = os.path.join(directory, SIDECAR)
  try:
    with open(path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(
        f"{path} is missing: it holds the shapes, dtypes and example counts "
        "of the shards beside it. Write the shards with python "
        "scripts/write_tfrecords.py (see README, 'Streaming from TFRecord "
        "files').") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e}); rewrite the shards "
                     "with scripts/write_tfrecords.py.") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{path} is not a {FORMAT} sidecar (its 'format' is "
                     f"{meta.get('format') if isinstance(meta, dict) else None!r});"
                     " rewrite the shards with scripts/write_tfrecords.py.")
  if meta.get("version") != VERSION:
    raise ValueError(f"{path} has version={meta.get('version')!r}; this "
                     f"tfmgpu reads version {VERSION}. Rewrite the shards "
                     "with this tfmgpu's scripts/write_tfrecords.py.")
  return meta


@data_lib.register_dataset(
    "tfrecord", "TFRecord shards written by scripts/write_tfrecords.py, "
    "streamed (pass path='DIR/*.tfrecord').",
    options=("path", "seed", "skip_damaged_shards"), streamed=True)
def _tfrecord(path: str | None = None, seed: int = 0,
              skip_damaged_shards: bool | None = None) -> TFRecordSource:
  return open_source(path, seed=seed, skip_damaged_shards=skip_damaged_shards)
