"""The input classifier and its helpers (`tfmgpu.training.inputs`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.training import inputs


def test_arrays_lists_and_dicts_are_classified_and_lists_become_tuples():
  x = {"a": np.zeros((5, 2)), "b": [np.ones((5,)), np.ones((5, 3))]}
  source = inputs.from_user(x, [0, 1, 2, 3, 4], np.ones(5))
  assert isinstance(source, inputs.ArrayData)
  assert source.num_examples == 5
  assert isinstance(source.x["b"], tuple)
  assert source.data[1].tolist() == [0, 1, 2, 3, 4]  # A list of numbers.
  padded = source.padded(4)
  assert [len(a) for a in tf.nest.flatten(padded)] == [8] * 6  # x3, y, mask, w.
  assert padded[2].tolist() == [1] * 5 + [0] * 3  # The row mask.


def test_datasets_and_dataset_functions_are_classified():
  ds = tf.data.Dataset.from_tensor_slices((np.zeros((6, 2)), np.zeros(6)))
  assert inputs.from_user(ds.batch(2)).cardinality == 3
  assert inputs.from_user(ds.repeat().batch(2)).cardinality == inputs.INFINITE
  assert inputs.from_user(ds.filter(lambda x, y: True).batch(2)
                          ).cardinality is None
  fn = lambda ctx: ds.batch(ctx.get_per_replica_batch_size(4))  # pylint: disable=unnecessary-lambda-assignment
  source = inputs.from_user(fn)
  assert isinstance(source, inputs.DatasetFnData)
  assert source.cardinality(tf.distribute.get_strategy()) == 2  # 4 + 2 rows.


def test_a_dataset_function_resumes_by_skipping_a_batch_per_fed_replica():
  fn = lambda ctx: tf.data.Dataset.range(100)  # pylint: disable=unnecessary-lambda-assignment
  ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                   num_replicas_in_sync=2)
  assert next(iter(inputs.dataset_fn_from_step(fn, 3)(ctx))).numpy() == 6
  assert inputs.dataset_fn_from_step(fn, 0) is fn

  class Seekable:
    def __call__(self, ctx):
      return tf.data.Dataset.range(100)
    def from_step(self, step):
      return ("seeked", step)

  assert inputs.dataset_fn_from_step(Seekable(), 7) == ("seeked", 7)


@pytest.mark.parametrize("validation, message", [
    ((np.zeros((3, 2)),), r"validation_data has 1 parts"),
    ((np.zeros((3, 2)), np.zeros(4)), r"x: 3, y: 4"),
])
def test_validation_data_is_checked_like_fit_inputs(validation, message):
  with pytest.raises(ValueError, match=message):
    inputs.from_validation_data(validation)


def test_a_generator_or_a_py_dataset_is_refused_by_name():
  """Not read as arrays without y: the error says what to pass instead."""

  class Batches(keras.utils.PyDataset):
    def __len__(self):
      return 1

    def __getitem__(self, i):
      return np.zeros((2, 3)), np.zeros((2,))

  for x in (iter([(np.zeros((2, 3)), np.zeros((2,)))]), Batches()):
    with pytest.raises(TypeError, match=rf"x is a {type(x).__name__}: .*"
                       r"tf.data.Dataset.from_generator"):
      inputs.from_user(x)


def test_ragged_or_sparse_training_arrays_say_to_pass_a_dataset():
  """They were 'not an array of numbers or strings (dtype object, ...)'."""
  ragged = tf.ragged.constant([[1, 2], [3]])
  sparse = tf.sparse.from_dense(np.eye(2, dtype="float32"))
  for x, y in ((ragged, np.zeros(2)), ({"a": np.zeros((2, 1))}, sparse)):
    kind = type(x if not isinstance(x, dict) else y).__name__
    with pytest.raises(TypeError, match=rf"is a {kind}; .*tf.data.Dataset."
                       r"from_tensor_slices\(\(x, y\)\).batch"):
      inputs.from_user(x, y)
