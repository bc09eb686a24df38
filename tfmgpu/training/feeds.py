"""How each step's batch reaches the replicas: the loop's three feeds.

- `ITERATOR`: a distributed `tf.data` iterator. TF splits each global batch
  (`strategy.experimental_distribute_dataset`) or reads each worker's
  pipeline (`distribute_datasets_from_function`) and prefetches each
  replica's part to its device. Any strategy, any cluster.
- `DEVICE`: in-memory arrays held on every replica's device; each replica
  gathers its rows there (`tfmgpu.training.resident`).
- `HOST_SPLIT`: a user's `tf.data.Dataset` of global batches read by one
  plain iterator on the host; inside the step function each replica takes
  its contiguous slice of the batch, the same rows TF's split gives it.
  The step also learns the batch's rows, so a short last batch split
  unevenly is averaged over its rows, as on one device (TF's iterator
  averages each replica's share as if every replica had as many rows).
  Chosen on one host when every replica's device is a CPU: their memory is
  the host's, so prefetching to them copies nothing useful, and one
  pipeline costs less host time than one per replica (measured: 14-37%
  faster steps on CPUs split into logical devices, `docs/benchmarks.md`).
  GPUs keep `ITERATOR`, whose prefetch overlaps the copy to the device.

`host_split_refusal` says why a dataset cannot be split on the host (the
Trainer logs the feed it picks); `split_batch` does the split.

`plan_input` turns what the user passed to `fit` into an `InputPlan`: the
global batch, the steps of an epoch and the feed, every size checked once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfmgpu import strategies as strategies_lib
from tfmgpu.training import inputs
from tfmgpu.training import resident

ITERATOR = "iterator"
DEVICE = "device"
HOST_SPLIT = "host_split"

DEFAULT_GLOBAL_BATCH = 64


def replica_device_types(strategy: tf.distribute.Strategy) -> set[str]:
  """The device types (`"CPU"`, `"GPU"`, ...) the replicas run on
  (`tfmgpu.strategies.replica_devices`: the default strategy's one replica
  counts as the first accelerator)."""
  return {tf.DeviceSpec.from_string(d).device_type or "CPU"
          for d in strategies_lib.replica_devices(strategy)}


def host_split_refusal(strategy: tf.distribute.Strategy,
                       element_spec: Any) -> str | None:
  """Why a dataset with `element_spec` cannot feed `strategy` by
  `HOST_SPLIT` (`None`: it can).

  It can on a one-host strategy (`resident.supports`) whose replicas are
  CPUs, when every leaf of an element is a dense tensor with a batch
  dimension.
  """
  if not resident.supports(strategy):
    return ("not a one-host strategy: each worker reads a pipeline of its "
            "own")
  kinds = replica_device_types(strategy) - {"CPU"}
  if kinds:
    return (f"the replicas run on {', '.join(sorted(kinds))}: TF's iterator "
            "prefetches each part to its device")
  for spec in tf.nest.flatten(element_spec):
    if type(spec) is not tf.TensorSpec:  # pylint: disable=unidiomatic-typecheck
      return f"an element holds a {type(spec).__name__}"
    if spec.shape.rank is None or spec.shape.rank < 1:
      return f"an element holds a tensor without a batch dimension ({spec})"
  return None


def rows_of(batch: Any) -> tf.Tensor:
  """The rows of a batch (its first leaf's first dimension)."""
  return tf.shape(tf.nest.flatten(batch)[0])[0]


def _slice_of(batch: Any, replica: int, replicas: int) -> Any:
  """Rows `[replica * k, (replica + 1) * k)` of every leaf, `k` the batch
  divided by `replicas` rounded up (TF's split; a short last batch leaves
  the last replicas fewer rows, or none)."""
  rows = rows_of(batch)
  per = (rows + replicas - 1) // replicas
  start = tf.minimum(replica * per, rows)
  stop = tf.minimum(start + per, rows)
  return tf.nest.map_structure(lambda t: t[start:stop], batch)


def split_batch(strategy: tf.distribute.Strategy, batch: Any) -> Any:
  """`batch` (one global batch, any nesting) as per-replica values: replica
  `i` gets the `i`-th contiguous slice. Call in cross-replica context."""
  replicas = strategy.num_replicas_in_sync
  if replicas == 1:
    return batch
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: _slice_of(batch, ctx.replica_id_in_sync_group, replicas))


# ---------------------------------------------------------- input plans


@dataclasses.dataclass(frozen=True)
class InputPlan:
  """How one `fit` reads its input: every size checked (`plan_input`).

  Attributes:
    source: the input (`inputs.from_user`).
    global_batch_size: examples per step over all replicas (arrays); `None`
      for a dataset, which brings its own batch.
    steps_per_epoch: steps of one epoch.
    feed: how batches reach the replicas (`ITERATOR`, `DEVICE`,
      `HOST_SPLIT`).
    refusal: why a `tf.data.Dataset` is not split on the host (`None`: it
      is, or the input is not one).
  """
  source: inputs.InputData
  global_batch_size: int | None
  steps_per_epoch: int
  feed: str = ITERATOR
  refusal: str | None = None

  def rows_left_out(self, shuffle: bool) -> str | None:
    """What a warning says when arrays' rows do not fill whole global
    batches (each epoch trains `steps_per_epoch` of them, where Keras' `fit`
    trains the remainder in a smaller last batch), else `None`."""
    if not isinstance(self.source, inputs.ArrayData):
      return None
    rows, batch = self.source.num_examples, self.global_batch_size
    if rows % batch == 0 or self.steps_per_epoch != rows // batch:
      return None
    which = ("a different few each epoch (shuffled)" if shuffle else
             "always the last ones (shuffle=False): they are never trained")
    return (f"{rows} examples make {rows // batch} global batches of "
            f"{batch}: each epoch trains {rows // batch * batch} and leaves "
            f"{rows % batch} out, {which}; Keras' fit would train them in a "
            "smaller last batch. To train every row, pass a global_batch_size "
            "that divides the examples, or a tf.data.Dataset (its short last "
            "batch is trained, as in Keras).")

  def describe(self) -> str:
    """The log line's words for where batches come from."""
    if self.feed == DEVICE:
      return "in-memory arrays on each replica's device"
    if self.feed == HOST_SPLIT:
      return ("the given tf.data.Dataset, read once on the host; each global "
              "batch is split over the replicas in the step")
    if isinstance(self.source, inputs.DatasetData):
      return ("the given tf.data.Dataset, its global batches split over the "
              f"replicas by TF's distributed iterator ({self.refusal})")
    return {inputs.ArrayData: "in-memory arrays through a tf.data pipeline",
            inputs.DatasetFnData: "the given dataset function (one pipeline "
                                  "per worker)"}[type(self.source)]


def plan_input(source: inputs.InputData, strategy: tf.distribute.Strategy, *,
               input_mode: str, epochs: int, global_batch_size: int | None,
               steps_per_epoch: int | None, streams: bool = False
               ) -> InputPlan:
  """Checks the sizes of one `fit` and picks its feed.

  Args:
    source: the input (`inputs.from_user`).
    strategy: the strategy it feeds.
    input_mode: the Trainer's (`"auto"`, `"device"`, `"tf_data"`).
    epochs, global_batch_size, steps_per_epoch: as `Trainer.fit` got them.
    streams: each worker streams the input endlessly on its own (a
      parameter-server cluster): any `steps_per_epoch` can be served, and
      a `tf.data.Dataset` cannot be given.

  Raises:
    ValueError: an indivisible or misplaced batch, too few examples, counts
      below 1, a dataset of unknown length without `steps_per_epoch`, ...
  """
  if epochs < 1:
    raise ValueError(f"epochs={epochs} must be >= 1.")
  if steps_per_epoch is not None and steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1.")
  global_batch_size = _global_batch(source, global_batch_size,
                                    strategy.num_replicas_in_sync)
  if streams:
    return InputPlan(source, global_batch_size, _streamed_steps(
        source, global_batch_size, steps_per_epoch))
  full = (_steps_in_one_pass(source.num_examples, global_batch_size)
          if isinstance(source, inputs.ArrayData)
          else _dataset_steps(source, strategy, steps_per_epoch))
  steps_per_epoch = steps_per_epoch or full
  if full is not None and steps_per_epoch > full:
    raise ValueError(f"steps_per_epoch={steps_per_epoch} needs more data "
                     f"than one pass gives ({full} steps); use at most "
                     f"{full}, or repeat the dataset.")
  feed, refusal = _feed(source, strategy, input_mode)
  return InputPlan(source, global_batch_size, steps_per_epoch, feed, refusal)


def _steps_in_one_pass(num_examples: int, global_batch_size: int) -> int:
  """Full global batches in one pass over the data.

  Raises:
    ValueError: fewer examples than one global batch.
  """
  full = num_examples // global_batch_size
  if full < 1:
    raise ValueError(f"global_batch_size={global_batch_size} is larger than "
                     f"the {num_examples} training examples; use a smaller "
                     "batch.")
  return full


def _global_batch(source: inputs.InputData, global_batch_size: int | None,
                  replicas: int) -> int | None:
  """The arrays' global batch (checked); `None` for a user's dataset."""
  if isinstance(source, inputs.ArrayData):
    global_batch_size = global_batch_size or DEFAULT_GLOBAL_BATCH
    inputs.check_global_batch(global_batch_size, replicas)
    return global_batch_size
  if global_batch_size is not None:
    raise ValueError(
        f"global_batch_size={global_batch_size} is for arrays: a "
        "tf.data.Dataset is batched by you (each element one global "
        "batch), a dataset function by "
        "input_context.get_per_replica_batch_size(...). Leave it unset.")
  return None


def _dataset_steps(source: inputs.InputData, strategy: tf.distribute.Strategy,
                   steps_per_epoch: int | None) -> int | None:
  """Batches in one pass of a user's dataset (`None`: endless, then
  `steps_per_epoch` is required)."""
  card = (source.cardinality if isinstance(source, inputs.DatasetData)
          else source.cardinality(strategy))
  if card == 0:
    raise ValueError("x is an empty dataset (0 batches); check its source "
                     "and its batch(..., drop_remainder=...).")
  if card in (None, inputs.INFINITE):
    if steps_per_epoch is None:
      what = "infinite" if card == inputs.INFINITE else "of unknown length"
      raise ValueError(
          f"x is a dataset {what}: pass steps_per_epoch=N (or, for a finite "
          "one, tell TF its length with "
          "dataset.apply(tf.data.experimental.assert_cardinality(n))).")
    return None
  return card


def _streamed_steps(source: inputs.InputData, global_batch_size: int | None,
                    steps_per_epoch: int | None) -> int:
  """Steps of an epoch when each worker streams endlessly."""
  if isinstance(source, inputs.DatasetData):
    raise ValueError(
        "Under parameter servers each worker builds its own input: give x "
        "as a dataset function fn(input_context) -> tf.data.Dataset (or "
        "arrays), not a tf.data.Dataset.")
  if isinstance(source, inputs.DatasetFnData):
    if not steps_per_epoch:
      raise ValueError("Under parameter servers a dataset function is "
                       "streamed endlessly by each worker: pass "
                       "steps_per_epoch=N.")
    return steps_per_epoch
  return steps_per_epoch or _steps_in_one_pass(source.num_examples,
                                               global_batch_size)


def _feed(source: inputs.InputData, strategy: tf.distribute.Strategy,
          input_mode: str) -> tuple[str, str | None]:
  """How `source` feeds the replicas, and why a dataset is not split on
  the host (`None` when it is, or for arrays)."""
  if isinstance(source, inputs.ArrayData):
    device = resident.use_device_data(input_mode, strategy, source.data)
    return (DEVICE if device else ITERATOR), None
  if input_mode == "device":
    raise ValueError("input_mode='device' holds in-memory arrays on the "
                     f"devices; x is a {type(source).__name__}. Use "
                     "input_mode='auto' or 'tf_data'.")
  if isinstance(source, inputs.DatasetFnData):
    return ITERATOR, None
  refusal = split_refusal(source, strategy, input_mode)
  return (ITERATOR if refusal else HOST_SPLIT), refusal


def split_refusal(source: inputs.DatasetData,
                  strategy: tf.distribute.Strategy,
                  input_mode: str) -> str | None:
  """Why the user's dataset `source` is not split on the host (`None`: it
  is): `input_mode='tf_data'`, or `host_split_refusal`."""
  if input_mode == "tf_data":
    return "input_mode='tf_data'"
  return host_split_refusal(strategy, source.dataset.element_spec)
