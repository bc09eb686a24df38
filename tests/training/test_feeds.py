"""The loop's feeds: a dataset split on the host gives each replica TF's rows.

`feeds.HOST_SPLIT` replaces TF's distributed iterator for a user's dataset
on one host of CPUs; these tests hold it to the iterator's results on full
batches, to one-device training when the last batch is short (which TF's
iterator averages per replica), and check when it is refused.
"""

import collections
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.parallel import inspection
from tfmgpu.training import distributed
from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training.loop import Trainer

ROWS, BATCH = 61, 12  # The last batch has 1 row: the other replicas get none.


def _data(rows=ROWS):
  rng = np.random.default_rng(1)
  x = {"a": rng.normal(size=(ROWS, 5)).astype(np.float32),
       "b": rng.normal(size=(ROWS, 3)).astype(np.float32)}
  y = (x["a"][:, 0] + x["b"][:, 1] > 0).astype(np.int32)
  w = rng.uniform(0.5, 1.5, size=ROWS).astype(np.float32)
  return tf.nest.map_structure(lambda a: a[:rows], (x, y, w))


def _model():
  a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
  h = keras.layers.Concatenate()([a, b])
  h = keras.layers.Dense(6, activation="tanh")(h)
  return keras.Model({"a": a, "b": b}, keras.layers.Dense(2)(h))


@pytest.fixture(scope="module")
def initial():
  keras.utils.set_random_seed(3)
  return _model().get_weights()


def _train(strategy, initial, split: bool, rows: int = ROWS,
           jit_compile: bool = False):
  """Weights and evaluation after 2 epochs of a weighted dataset, with the
  host split on or turned off (`input_mode="tf_data"`)."""
  with strategy.scope():
    model = _model()
  model.set_weights(initial)
  x, y, w = _data(rows)
  dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH)
  trainer = Trainer(model, strategy=strategy, optimizer="sgd",
                    learning_rate=0.1, metrics=["accuracy"], verbose=0,
                    input_mode="auto" if split else "tf_data",
                    jit_compile=jit_compile)
  trainer.fit(dataset, epochs=2)
  scores = trainer.evaluate(dataset)
  assert (True in trainer.evaluator.functions) == split  # pylint: disable=protected-access
  return model.get_weights(), scores


@pytest.mark.parametrize("replicas", [2])  # 4: the same path.
def test_a_dataset_split_on_the_host_trains_as_tf_splits_it(
    initial, replicas, caplog):
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=replicas)
  caplog.set_level("INFO")
  full = 5 * BATCH  # Full batches: TF's per-replica average is exact.
  split_weights, split_scores = _train(strategy, initial, True, full)
  assert "read once on the host" in caplog.text
  tf_weights, tf_scores = _train(strategy, initial, False, full)
  assert "by TF's distributed iterator (input_mode='tf_data')" in caplog.text
  assert max(np.abs(a - b).max() for a, b in zip(initial, tf_weights)) > 1e-2
  for got, want in zip(split_weights, tf_weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert split_scores["count"] == tf_scores["count"] == full
  for key in ("loss", "accuracy"):
    assert split_scores[key] == pytest.approx(tf_scores[key], rel=1e-5)


# 4 replicas (3 without a row) take the path of 2 (1 without): dropped.
@pytest.mark.parametrize("replicas", [2])
def test_a_short_last_batch_split_on_the_host_trains_as_one_device(
    initial, replicas):
  """61 rows in batches of 12: the last batch's one row lands on one
  replica, the other gets none; its loss is averaged over 1 row, as on one device, whether the
  host or TF's iterator splits it (the step sums the replicas' rows: it
  divided by 1 x replicas, 2e-2 off)."""
  one_weights, one_scores = _train(tf.distribute.get_strategy(), initial,
                                   True)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=replicas)
  split_weights, split_scores = _train(strategy, initial, True)
  for got, want in zip(split_weights, one_weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert split_scores["count"] == one_scores["count"] == ROWS
  for key in ("loss", "accuracy"):
    assert split_scores[key] == pytest.approx(one_scores[key], rel=1e-5)
  # XLA too: the rows are summed outside the compiled function (inside,
  # the all-reduce failed: "merge_call called while defining a new graph").
  tf_weights, _ = _train(strategy, initial, False, jit_compile=True)
  for got, want in zip(tf_weights, one_weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_split_batch_gives_each_replica_tfs_rows():
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=3)
  dataset = tf.data.Dataset.range(20).batch(9)
  want = [[b.numpy().tolist() for b in strategy.experimental_local_results(v)]
          for v in strategy.experimental_distribute_dataset(dataset)]

  @tf.function
  def split(batch):
    parts = feeds.split_batch(strategy, {"rows": batch})
    return strategy.experimental_local_results(parts["rows"])

  got = [[t.numpy().tolist() for t in split(b)] for b in dataset]
  assert got == want == [[[0, 1, 2], [3, 4, 5], [6, 7, 8]],
                         [[9, 10, 11], [12, 13, 14], [15, 16, 17]],
                         [[18], [19], []]]


def _fake_strategy(*devices):
  """A one-host strategy as `host_split_refusal` sees it, on `devices`."""
  fake = object.__new__(type("FakeMirrored",
                             (tf.distribute.MirroredStrategy,), {}))
  fake._extended = types.SimpleNamespace(worker_devices=devices)  # pylint: disable=protected-access
  return fake


@pytest.mark.parametrize("devices, spec, refusal", [
    (("/device:CPU:0", "/device:CPU:1"),
     (tf.TensorSpec([None, 4]), tf.TensorSpec([None])), None),
    (("/job:localhost/replica:0/task:0/device:GPU:0",
      "/job:localhost/replica:0/task:0/device:GPU:1"),
     (tf.TensorSpec([None, 4]), tf.TensorSpec([None])),
     "the replicas run on GPU: TF's iterator prefetches"),
    (("/device:CPU:0",),
     (tf.RaggedTensorSpec([None, None]), tf.TensorSpec([None])),
     "an element holds a RaggedTensorSpec"),
    (("/device:CPU:0",), (tf.TensorSpec([4]), tf.TensorSpec([])),
     "a tensor without a batch dimension"),
])
def test_host_split_is_refused_where_it_cannot_help(devices, spec, refusal):
  got = feeds.host_split_refusal(_fake_strategy(*devices), spec)
  if refusal is None:
    assert got is None
  else:
    assert refusal in got


def test_a_multi_worker_strategy_keeps_tfs_iterator():
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  refusal = feeds.host_split_refusal(
      strategy, (tf.TensorSpec([None, 4]), tf.TensorSpec([None])))
  assert "not a one-host strategy: each worker reads a pipeline" in refusal


def test_every_feed_has_a_train_function():
  strategy = tf.distribute.get_strategy()
  for feed in (feeds.ITERATOR, feeds.DEVICE, feeds.HOST_SPLIT):
    fn = distributed.make_train_function(strategy, lambda *b: {}, feed=feed)
    assert callable(fn)


def test_one_iterator_on_the_host_feeds_each_replica_on_its_device(
    initial, cpu_devices):
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = _model()
  model.set_weights(initial)
  x, y, _ = _data()
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  trainer = Trainer(model, strategy=strategy, verbose=0)
  trainer.fit(dataset, epochs=1)
  fn = trainer._train_fns[(None, feeds.HOST_SPLIT)]  # pylint: disable=protected-access
  ops = inspection.op_placements(
      fn.get_concrete_function(iter(dataset), tf.constant(1)))
  reads = [p for p in ops if p.type.startswith("IteratorGetNext")]
  assert len(reads) == 1, reads
  matmuls = collections.Counter(p.device for p in ops if p.type == "MatMul")
  assert set(matmuls) == set(cpu_devices[:2]), matmuls


def test_one_input_plan_checks_the_sizes_of_both_executions():
  """Issue 25: the epochs/steps checks are written once, in
  `feeds.plan_input`, for synchronous and streamed (parameter-server)
  training."""
  strategy = tf.distribute.get_strategy()
  x, y = np.zeros((10, 2), np.float32), np.zeros(10, np.int32)
  arrays = inputs.from_user(x, y)
  plan = feeds.plan_input(arrays, strategy, input_mode="tf_data", epochs=1,
                          global_batch_size=4, steps_per_epoch=None)
  assert (plan.global_batch_size, plan.steps_per_epoch, plan.feed) == (
      4, 2, feeds.ITERATOR)
  streamed = feeds.plan_input(arrays, strategy, input_mode="auto", epochs=1,
                              global_batch_size=4, steps_per_epoch=7,
                              streams=True)
  assert streamed.steps_per_epoch == 7  # Each worker streams endlessly.
  for streams in (False, True):
    for counts, match in (((0, None), r"epochs=0 must be >= 1"),
                          ((1, 0), r"steps_per_epoch=0 must be >= 1")):
      with pytest.raises(ValueError, match=match):
        feeds.plan_input(arrays, strategy, input_mode="auto",
                         epochs=counts[0], global_batch_size=4,
                         steps_per_epoch=counts[1], streams=streams)
  dataset = inputs.from_user(tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
  with pytest.raises(ValueError, match=r"each worker builds its own input"):
    feeds.plan_input(dataset, strategy, input_mode="auto", epochs=1,
                     global_batch_size=None, steps_per_epoch=2, streams=True)



def test_the_epoch_loss_weighs_a_short_last_batch_by_its_rows(initial):
  """As Keras reports it: the mean of the batches' losses weighed by their
  rows (it was the plain mean of the steps': 1.97 against Keras' 2.57)."""
  x, y, w = _data()
  reference = _model()
  reference.set_weights(initial)
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=(
      keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
  want = reference.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2,
                       shuffle=False, verbose=0).history["loss"]
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = _model()
  model.set_weights(initial)
  dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH)
  got = Trainer(model, strategy=strategy, optimizer="sgd", learning_rate=0.1,
                verbose=0).fit(dataset, epochs=2).history["loss"]
  np.testing.assert_allclose(got, want, rtol=1e-5)
