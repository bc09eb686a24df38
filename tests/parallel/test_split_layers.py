"""The split layers rebuild from their configs, and `.keras` files of split
models load back with the same weights (each split layer's held in the
unsplit layer's form)."""

import copy

import keras
import numpy as np
import pytest

from tfmgpu.models import gpt
from tfmgpu.parallel import activations
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


def test_a_softmax_is_applied_to_the_joined_output(cpu_devices):
  """Each shard applied the activation to its slice: a softmax over an
  output split in two normalised each half on its own."""
  layer = split_kernel.SplitKernelDense("abc,cd->abd", (8, 6), 1,
                                        cpu_devices[:2], activation="softmax")
  kernel = layer.get_weights()[0]
  got = keras.ops.convert_to_numpy(layer(X))
  want = keras.ops.convert_to_numpy(keras.ops.softmax(
      np.einsum("abc,cd->abd", X, kernel)))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert activations.acts_elementwise(keras.activations.get("gelu"))
  assert not activations.acts_elementwise(lambda x: x / keras.ops.sum(x))


def test_a_column_split_dense_applies_a_softmax_after_its_gather(
    cpu_devices):
  """ColumnParallelDense applied its activation per shard: a softmax's
  rows summed to 2.0 over two shards (0.673 off)."""
  layer = tensor.ColumnParallelDense(6, cpu_devices[:2], activation="softmax")
  got = keras.ops.convert_to_numpy(layer(X))
  kernel, bias = layer.get_weights()
  want = keras.ops.convert_to_numpy(keras.ops.softmax(X @ kernel + bias))
  np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(ValueError, match=r"activation='softmax' reads the "
                     r"whole output.*gather_output=True"):
    tensor.ColumnParallelDense(6, cpu_devices[:2], activation="softmax",
                               gather_output=False)(X)


def test_the_element_wise_probe_slices_along_the_split_axis():
  """The probe sliced a 2-D input's last axis only: a softmax over axis -2
  split along that axis passed (0.912 off); an unhashable activation
  crashed the cache; a PReLU activation was built by the probe."""
  import functools  # pylint: disable=g-import-not-at-top
  over_rows = functools.partial(keras.ops.softmax, axis=-2)
  assert not activations.acts_elementwise(over_rows, 3, 1)
  assert activations.acts_elementwise(over_rows, 3, 2)

  class Scaled:  # Unhashable (defines __eq__ without __hash__).

    def __eq__(self, other):
      return isinstance(other, Scaled)

    def __call__(self, x):
      return 2.0 * x

  assert activations.acts_elementwise(Scaled(), 3, 2)
  prelu = keras.layers.PReLU()
  assert not activations.acts_elementwise(prelu) and not prelu.built


def test_the_bias_axis_skips_the_unbiased_axes_between():
  """Keras' bias spans the output from its first biased axis: `be` of
  `abde` gives a bias of shape (b, 1, e), so e is its axis 2 (not 1)."""
  layer = keras.layers.EinsumDense("abc,cde->abde", output_shape=(4, 2, 3),
                                   bias_axes="be")
  layer.build((2, 4, 8))
  assert tuple(layer.bias.shape) == (4, 1, 3)
  assert split_kernel.bias_axis_of(layer, 2) == 2  # e
  assert split_kernel.bias_axis_of(layer, 1) is None  # d: not biased
  assert split_kernel.bias_axis_of(layer, 0) is None  # c: contracted


def test_attention_parts_that_do_not_split_by_heads_are_refused(cpu_devices):
  """A gate (by heads, from the whole query) and the scores (each shard's
  heads only) would come out wrong: refused by name."""
  from tfmgpu.parallel import split_hub_attention  # pylint: disable=g-import-not-at-top
  for gated in (True, False):
    layer = keras.layers.MultiHeadAttention(2, 4, use_gate=gated, name="mha")
    layer(X, X)
    named = {id(v): f"mha/{v.path}" for v in layer.weights}
    query = f"mha/{layer.query_dense.kernel.path}"
    if gated:
      with pytest.raises(ValueError, match=r"attention 'mha.*use_gate=True"):
        split_hub_attention.fuse(layer, {query: 1}, cpu_devices[:2], named)
      continue
    assert split_hub_attention.fuse(layer, {query: 1}, cpu_devices[:2], named)
    with pytest.raises(ValueError, match=r"return_attention_scores=True on an "
                       r"attention split by heads over 2 devices"):
      layer(X, X, return_attention_scores=True)


def test_optimizers_that_would_update_shards_otherwise_are_refused(
    cpu_devices):
  """A plain tensor_parallel model trained with Adafactor under a Trainer
  was not checked at all; a MultiOptimizer keyed by the whole kernel's path
  missed its shards (0.0182 off), and one with a function for its map was
  accepted before it had built any optimizer."""
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((8,))
  hidden = keras.layers.Dense(8, name="ff_mlp_up")(inputs)
  model = tensor.tensor_parallel(keras.Model(inputs, keras.layers.Dense(
      8, name="ff_mlp_down")(hidden)), cpu_devices[:2])
  sgd = keras.optimizers.SGD

  def routed(routes):
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(sgd(0.1), routes))

  refusals = {
      "Adafactor factors": keras.optimizers.Adafactor(),
      "routes split layer 'ff_mlp_up' by path": routed({
          "ff_mlp_up/kernel": sgd(0.0)}),
      "a function for optimizer_map": keras.optimizers.MultiOptimizer(
          lambda v: sgd(0.1)),
  }
  for why, optimizer in refusals.items():
    with pytest.raises(ValueError, match=f"optimizer: .*{why}.*splits the "
                       "weights of ff_mlp_down, ff_mlp_up into shards"):
      Trainer(model, optimizer=optimizer, loss="mse", verbose=0)
  Trainer(model, optimizer=routed({"other/.*": sgd(0.0)}), loss="mse",
          verbose=0)


@pytest.mark.parametrize("policy", ["float16", "mixed_float16", "float32"])
def test_a_split_dense_computes_as_the_dense_under_each_policy(policy,
                                                               cpu_devices):
  """A Dense's shards multiply as `Dense.call` does (matmul): TF's CPU
  (oneDNN) einsum `...i,io->...o` returns wrong float16 values (an MLP
  split by tensor parallelism was 1.55e-2 off on logits of 0.16)."""
  from tfmgpu.parallel import split_blocks  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  dense = keras.layers.Dense(32, activation="gelu", dtype=policy,
                             bias_initializer="glorot_uniform")
  x = np.random.RandomState(1).normal(size=(2, 8, 16)).astype("float32")
  want = keras.ops.convert_to_numpy(dense(x)).astype("float32")
  tolerance = (1e-6 if policy == "float32" else 4e-3) * np.abs(want).max()
  for axis in (0, 1):  # Rows (summed) and columns.
    split = split_blocks._split_dense(  # pylint: disable=protected-access
        dense, "dense/kernel", axis, cpu_devices[:2])
    got = keras.ops.convert_to_numpy(split(x)).astype("float32")
    np.testing.assert_allclose(got, want, atol=tolerance)
