"""Dataset registry and the per-replica input pipeline."""

import numpy as np
import pytest

from tfmgpu import data


def test_registry_holds_exactly_todays_names():
  assert set(data.available_datasets()) == {
      "digits", "digits8x8", "synthetic", "npz", "tfrecord", "stdlib_text",
      "stdlib_modules",
      "mnist", "fashion_mnist", "cifar10"}


def test_default_digits_are_real_and_shuffled():
  arrays = data.load_dataset()
  assert arrays.name == "digits"
  assert arrays.x_train.shape == (4000, 28, 28, 1)
  assert arrays.x_test.shape == (1000, 28, 28, 1)
  assert arrays.x_train.dtype == np.float32 and arrays.x_train.max() <= 1.0
  assert arrays.num_classes == 10
  # The source is sorted by label; the split must hold every class.
  assert set(np.unique(arrays.y_test)) == set(range(10))
  assert not np.all(np.diff(arrays.y_train) >= 0)


def test_digits8x8_and_synthetic():
  small = data.load_dataset("digits8x8")
  assert small.input_shape == (8, 8, 1) and small.num_classes == 10
  syn = data.load_dataset("synthetic", num_examples=100, input_shape=(4,),
                          num_classes=3)
  assert syn.input_shape == (4,) and syn.num_classes == 3
  assert len(syn.x_train) + len(syn.x_test) == 100


def test_npz_round_trip(tmp_path):
  path = tmp_path / "d.npz"
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, (n, 5, 5)).astype(np.uint8) for n in (10, 4)]
  np.savez(path, x_train=images[0], y_train=np.arange(10) % 2,
           x_test=images[1], y_test=np.arange(4) % 2)
  arrays = data.load_dataset("npz", path=str(path))
  assert arrays.input_shape == (5, 5, 1) and arrays.num_classes == 2
  np.testing.assert_array_equal(arrays.x_train[..., 0],
                                images[0].astype(np.float32) / 255)
  np.testing.assert_array_equal(arrays.x_test[..., 0],
                                images[1].astype(np.float32) / 255)


def test_npz_features_are_used_as_given(tmp_path):
  """Found by a new user: x was divided by 255 whenever its max was above
  1, each split on its own (x_train scaled, x_test kept), so the model
  trained and predicted on other numbers than the file holds. Token ids
  (int32) are not images either."""
  rng = np.random.default_rng(0)
  x_train = (rng.normal(size=(20, 6)) * 3 + 4).astype(np.float32)
  x_test = rng.uniform(0, 0.9, size=(8, 6)).astype(np.float32)
  np.savez(tmp_path / "d.npz", x_train=x_train, y_train=np.zeros(20, int),
           x_test=x_test, y_test=np.zeros(8, int))
  arrays = data.load_dataset("npz", path=str(tmp_path / "d.npz"))
  np.testing.assert_array_equal(arrays.x_train, x_train)
  np.testing.assert_array_equal(arrays.x_test, x_test)
  ids = rng.integers(0, 5000, (8, 6)).astype(np.int32)
  np.savez(tmp_path / "ids.npz", x_train=ids, y_train=np.zeros(8, int),
           x_test=ids, y_test=np.zeros(8, int))
  arrays = data.load_dataset("npz", path=str(tmp_path / "ids.npz"))
  assert arrays.x_train.dtype == np.float32
  np.testing.assert_array_equal(arrays.x_test, ids)
  np.savez(tmp_path / "mixed.npz", x_train=ids.astype(np.uint8),
           y_train=np.zeros(8, int), x_test=x_test, y_test=np.zeros(8, int))
  with pytest.raises(ValueError, match=r"dataset '.*mixed.npz': x_train is "
                     r"uint8 but x_test is float32; .* Save both with the "
                     r"same dtype."):
    data.load_dataset("npz", path=str(tmp_path / "mixed.npz"))


def test_npz_sequences_keep_their_shape_and_labels_are_checked(tmp_path):
  """Found by a new user: a float (n, T, F) time series got a channel axis
  as if it were grey images ((T, F, 1): a model built for (T, F) failed),
  though the docs say x is used as it is; one-hot labels and an x_test of
  another width were found only inside training; an empty x_test was
  reported as a test loss of 0."""
  rng = np.random.default_rng(0)
  series = rng.normal(size=(12, 5, 3)).astype(np.float32)

  def save(name, **arrays):
    np.savez(tmp_path / name, **{
        "x_train": series, "y_train": np.arange(12) % 2,
        "x_test": series[:4], "y_test": np.arange(4) % 2, **arrays})
    return str(tmp_path / name)

  arrays = data.load_dataset("npz", path=save("ts.npz"))
  assert arrays.input_shape == (5, 3)
  np.testing.assert_array_equal(arrays.x_test, series[:4])
  with pytest.raises(ValueError, match=r"y_train in '.*hot.npz' has shape "
                     r"\(12, 2\) and one 1 per row: one-hot labels. Save "
                     r"the class indices instead \(y_train.argmax\(axis=1\)\)"
                     r"; the npz dataset takes class indices only"):
    data.load_dataset("npz", path=save(
        "hot.npz", y_train=np.eye(2)[np.arange(12) % 2]))
  with pytest.raises(ValueError, match=r"y_test in '.*reg.npz' holds non-"
                     r"integer labels.*for other targets \(regression\) "
                     r"give your own loader, --dataset=my_data.py:load"):
    data.load_dataset("npz", path=save("reg.npz", y_test=np.full(4, 0.5)))
  with pytest.raises(ValueError, match=r"x_test holds examples of shape "
                     r"\(5, 4\) but x_train of shape \(5, 3\); the model is "
                     r"built for x_train's"):
    data.load_dataset("npz", path=save(
        "wide.npz", x_test=rng.normal(size=(4, 5, 4)).astype(np.float32)))
  with pytest.raises(ValueError, match=r"x_test has no rows \(shape \(0, 5, "
                     r"3\)\). Give both splits examples.*predict reads it"):
    data.load_dataset("npz", path=save(
        "empty.npz", x_test=series[:0], y_test=np.zeros(0, int)))
  mnist = data.load_dataset("mnist", path=save("ts.npz"))  # Images: a channel.
  assert mnist.input_shape == (5, 3, 1)


def test_check_shapes_pairs_a_loaders_inputs_by_name():
  """Several inputs (a dict per split) are compared key by key, whatever
  their order; the message names the input."""
  z = np.zeros
  arrays = data.Arrays("mine", {"a": z((3, 2)), "b": z((3, 5))}, z(3, int),
                       {"b": z((2, 5)), "a": z((2, 2))}, z(2, int), 1)
  data.check_shapes(arrays)
  arrays = data.Arrays("mine", {"a": z((3, 2))}, z(3, int),
                       {"a": z((2, 3))}, z(2, int), 1)
  with pytest.raises(ValueError, match=r"dataset 'mine': x_test\['a'\] holds "
                     r"examples of shape \(3,\) but x_train\['a'\] of shape "
                     r"\(2,\)"):
    data.check_shapes(arrays)


def test_npz_errors(tmp_path):
  with pytest.raises(ValueError, match=r"dataset 'npz' needs path="):
    data.load_dataset("npz")
  with pytest.raises(FileNotFoundError, match=r"path='.*nope.npz' does not exist"):
    data.load_dataset("npz", path=str(tmp_path / "nope.npz"))
  # Issue 29 item 5: said on loading, not after predicting every row.
  np.savez(tmp_path / "long.npz", x_train=np.zeros((3, 2)),
           y_train=np.zeros(3), x_test=np.zeros((2, 2)), y_test=np.zeros(5))
  with pytest.raises(ValueError, match=r"dataset 'npz': '.*long.npz' holds 2 "
                     r"rows in x_test but 5 in y_test. Give one label per "
                     r"example: as many rows in y_test as in x_test."):
    data.load_dataset("npz", path=str(tmp_path / "long.npz"))
  (tmp_path / "d.csv").write_text("a,b,c\n1,2,3\n")
  with pytest.raises(ValueError, match=r"d.csv' is not a valid .npz file \(12 "
                     r"bytes: a text file, starting 'a,b,c'; for CSV or other "
                     r"text, give your own loader"):
    data.load_dataset("npz", path=str(tmp_path / "d.csv"))
  np.savez(tmp_path / "bad.npz", x_train=np.zeros(3))
  with pytest.raises(ValueError, match=r"lacks arrays \['y_train', 'x_test', "
                     r"'y_test'\]"):
    data.load_dataset("npz", path=str(tmp_path / "bad.npz"))


def test_unknown_dataset_lists_names():
  with pytest.raises(ValueError, match=r"Unknown dataset name='mnits'. "
                     r"Did you mean 'mnist'\? "
                     r"Available names: cifar10, digits"):
    data.load_dataset("mnits")


def test_offline_download_says_how_to_use_a_local_file(monkeypatch):
  import keras

  def offline():
    raise OSError("[Errno -3] Temporary failure in name resolution")

  monkeypatch.setattr(keras.datasets.mnist, "load_data", offline)
  with pytest.raises(data.DatasetUnavailableError,
                     match=r"dataset 'mnist' must be downloaded.*Temporary "
                     r"failure.*--data_path=FILE.npz"):
    data.load_dataset("mnist")


def test_indivisible_global_batch_is_a_clear_error():
  from tfmgpu.training import inputs  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"global_batch_size=30 is not divisible "
                     r"by the 4 replicas of the strategy. Use a multiple of 4, "
                     r"e.g. 28 or 32."):
    inputs.check_global_batch(30, 4)
  assert inputs.check_global_batch(32, 4) == 8


def test_epoch_order_is_fixed_by_seed_and_epoch():
  from tfmgpu.training import inputs  # pylint: disable=g-import-not-at-top
  a, b = inputs.epoch_order(50, 1, 3), inputs.epoch_order(50, 1, 3)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, inputs.epoch_order(50, 1, 4))
  assert sorted(a) == list(range(50))


class _Ctx:
  def __init__(self, pipelines, pipeline_id, replicas):
    self.num_input_pipelines = pipelines
    self.input_pipeline_id = pipeline_id
    self.num_replicas_in_sync = replicas

  def get_per_replica_batch_size(self, global_batch):
    return global_batch // self.num_replicas_in_sync


def test_sharded_pipelines_cover_each_global_batch():
  """Two workers' first batches together are the single-process first batch."""
  x = np.arange(40, dtype=np.float32)[:, None]
  y = np.arange(40, dtype=np.int32)
  from tfmgpu.training import inputs  # pylint: disable=g-import-not-at-top
  fn = inputs.array_dataset_fn((x, y), global_batch_size=8,
                               order=inputs.epoch_order(40, 3, 1),
                               drop_remainder=True)
  single = next(iter(fn(None)))[1].numpy()
  shards = [next(iter(fn(_Ctx(2, i, 2))))[1].numpy() for i in range(2)]
  assert sorted(np.concatenate(shards)) == sorted(single)
  assert len(shards[0]) == 4


def test_distribute_rejects_indivisible_batch():
  import tfmgpu
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=4)
  with pytest.raises(ValueError, match=r"global_batch_size=6 is not divisible"):
    from tfmgpu.training import inputs  # pylint: disable=g-import-not-at-top
    inputs.distribute_arrays(strategy, (np.zeros((10, 2)), np.zeros(10)),
                             global_batch_size=6)


def test_float_targets_without_a_loss_are_refused_not_cast():
  """A loader's float targets trained with the default loss (sparse
  categorical cross-entropy) were cast to class indices, silently:
  targets in (0, 1) all read as class 0 (a new user's trial)."""
  x = np.zeros((4, 3), np.float32)

  def arrays(y):
    return data.Arrays("mine", x, y, x, y, None)
  with pytest.raises(ValueError, match=r"^dataset 'mine': y_train\[1\]=0\.25 "
                     r"is not a class index, and no --loss was given.*read it "
                     r"as class 0\. Give the loss your targets need: "
                     r"--loss=mse"):
    data.check_labels_for_default_loss(
        arrays(np.array([1.0, 0.25, 0.5, 2.0], np.float32)))
  with pytest.raises(ValueError, match=r"y_train holds one-hot rows \(shape "
                     r"\(4, 3\)\).*Return y\.argmax\(-1\)"):
    data.check_labels_for_default_loss(
        arrays(np.eye(3, dtype=np.float32)[[0, 1, 2, 0]]))
  with pytest.raises(ValueError, match=r"y_train\[2\]=nan is not a class "
                     r"index.*has no class for it"):  # Not int(nan)'s error.
    data.check_labels_for_default_loss(
        arrays(np.array([1.0, 0.0, np.nan, 2.0], np.float32)))
  for fine in (np.array([0.0, 1.0, 2.0, 1.0], np.float32),  # Whole numbers.
               np.array([0, 1, 2, 1])):  # Integers.
    data.check_labels_for_default_loss(arrays(fine))



def test_a_negative_label_is_said(caplog):
  """A trial: a negative label was met later as `units=None` in the user's
  model, with no word of the label."""
  from tfmgpu.datasets import registry  # pylint: disable=g-import-not-at-top
  x = np.zeros((8, 3), np.float32)
  y = np.array([0, 1] * 4)
  assert registry.user_arrays("mine", ((x, y), (x, y))).num_classes == 2
  y[3] = -1
  with caplog.at_level("WARNING"):
    assert registry.user_arrays("mine", ((x, y), (x, y))).num_classes is None
  assert "y_train[3]=-1 is negative: the integer targets are not class" \
      in caplog.text
