"""The split layers rebuild from their configs, and `.keras` files of split
models load back with the same weights (each split layer's held in the
unsplit layer's form)."""

import copy

import keras
import numpy as np
import pytest

from tfmgpu.models import gpt
from tfmgpu.parallel import split_embedding
from tfmgpu.parallel import split_kernel
from tfmgpu.parallel import tensor

X = np.random.RandomState(0).randn(2, 4, 8).astype("float32")
IDS = np.array([[1, 5, 7, 0], [2, 3, 4, 6]], "int32")


def _layers(devices):
  """`[(layer, its inputs)]`: one of each split layer."""
  return [
      (tensor.ColumnParallelDense(6, devices, activation="relu"), (X,)),
      (tensor.RowParallelDense(6, devices), (X,)),
      (tensor.HeadParallelAttention(2, 4, devices), (X, X)),
      (split_kernel.SplitKernelDense("abc,cde->abde", (8, 2, 4), 1, devices,
                                     bias_shape=(2, 4)), (X,)),
      (split_embedding.VocabParallelEmbedding(8, 4, devices), (IDS,)),
      (split_embedding.VocabParallelEmbedding(
          8, 8, devices, reversible=True, tie_weights=False,
          logit_soft_cap=3.0), (X,)),
  ]


def test_each_split_layer_rebuilds_from_its_config(cpu_devices):
  for layer, inputs in _layers(cpu_devices[:2]):
    kwargs = {"reverse": True} if getattr(layer, "reversible", False) else {}
    want = keras.ops.convert_to_numpy(layer(*inputs, **kwargs))
    config = layer.get_config()
    again = type(layer).from_config(copy.deepcopy(config))
    again(*inputs, **kwargs)
    assert again.get_config() == config, type(layer).__name__
    again.set_weights(layer.get_weights())
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(again(*inputs, **kwargs)), want,
        atol=1e-6, err_msg=type(layer).__name__)
    assert ([v.value.device for v in again.weights]
            == [v.value.device for v in layer.weights])


def test_a_split_models_keras_file_round_trips(cpu_devices, tmp_path):
  keras.utils.set_random_seed(0)
  model = gpt.gpt((8,), 16, size="tiny", num_heads=2)
  split = tensor.tensor_parallel(model, cpu_devices[:2])
  path = str(tmp_path / "split.keras")
  split.save(path)
  loaded = keras.saving.load_model(path)
  assert [type(l) for l in loaded.layers] == [type(l) for l in split.layers]
  ids = np.random.RandomState(1).randint(0, 16, (2, 8))
  np.testing.assert_allclose(loaded.predict(ids, verbose=0),
                             model.predict(ids, verbose=0), atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(input_dim=7), "vocabulary"),
])
def test_a_vocabulary_t_does_not_divide_is_refused(cpu_devices, bad, match):
  with pytest.raises(ValueError, match=match):
    split_embedding.VocabParallelEmbedding(
        devices=cpu_devices[:2], output_dim=4, **bad)
