"""KV-cache memory per device equals the bytes of the caches generation
actually makes on each device of a placed `gpt`; keras_hub counts its
key/value heads."""

import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import devices as devices_lib
from tfmgpu import models
from tfmgpu.generation import hub_cache
from tfmgpu.generation import placed as placed_gen
from tfmgpu.parallel import hybrid
from tfmgpu.parallel import kv_cache


@pytest.fixture(scope="module")
def gpt():
  return models.build_model("gpt", input_shape=(24,), num_classes=50,
                            seed=3)


def _made(adapter, batch, context):
  """`{device: bytes}` of the caches a placed adapter makes."""
  out = {}
  for t in tf.nest.flatten(adapter.empty_cache(batch, context)):
    device = devices_lib.canonical_device(t.device)
    out[device] = out.get(device, 0) + t.numpy().nbytes
  return out


@pytest.mark.parametrize("sizes", [
    {"tensor": 2}, {"stages": 2}, {"stages": 2, "tensor": 2},
    {"data": 2, "tensor": 2}])
def test_estimate_equals_the_caches_generation_makes(gpt, sizes):
  layout = hybrid.Layout(**sizes)
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")][:layout.num_devices]
  placed = hybrid.build_layout(gpt, layout, devices=cpus)
  made = _made(placed_gen.placed_adapter(placed), 4, 10)
  copy0 = cpus[:layout.stages * layout.tensor]
  estimate = kv_cache.per_device(gpt, layout, batch=4, context=10,
                                 devices=copy0)
  assert estimate == {d: made.get(d, 0) for d in copy0}
  # Per block: 2 (keys, values) x rows x 10 positions x 16 per head x 4 B.
  rows = 4 // layout.data
  per_head = 2 * rows * 10 * 16 * 4
  assert sum(estimate.values()) == 2 * 2 * per_head  # 2 blocks, 2 heads.


def test_keras_hub_counts_key_value_heads():
  keras_hub = pytest.importorskip("keras_hub")
  lm = keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(
      vocabulary_size=64, num_layers=3, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
                                      preprocessor=None)
  estimate = kv_cache.per_device(lm, hybrid.Layout(), batch=2, context=8)
  assert estimate == {"/device:GPU:0": 2 * 2 * 8 * 2 * 4 * 4 * 3}
  made = hub_cache.HubCache(lm).empty_cache(2, 8)  # Its own contract's.
  assert made[0].numpy().nbytes == estimate["/device:GPU:0"]


def test_serving_table_and_bad_sizes(gpt):
  table = kv_cache.serving_table(gpt, hybrid.Layout(stages=2, tensor=2),
                                 batch=32, context=24)
  assert "KV cache" in table and table.count("/device:GPU:") == 4
  with pytest.raises(ValueError, match="context=0 must be an int >= 1"):
    kv_cache.per_device(gpt, hybrid.Layout(), batch=1, context=0)


@pytest.fixture(scope="module")
def llama():
  keras_hub = pytest.importorskip("keras_hub")
  return keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(
      vocabulary_size=64, num_layers=2, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
                                        preprocessor=None)


@pytest.mark.parametrize("sizes", [{"stages": 2}, {"tensor": 2}])
def test_keras_hub_placed_estimate_equals_the_caches_made(llama, sizes):
  layout = hybrid.Layout(**sizes)
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")][:layout.num_devices]
  placed = hybrid.build_layout(llama, layout, devices=cpus)
  made = _made(placed_gen.placed_adapter(placed), 3, 10)
  estimate = kv_cache.per_device(llama, layout, batch=3, context=10,
                                 devices=cpus)
  assert estimate == {d: made.get(d, 0) for d in cpus}
  # Each block's whole cache (2 x 3 rows x 10 x 2 key/value heads x 4 x
  # 4 B) on its stage; under tensor 2 one head's half on each shard.
  block = 2 * 3 * 10 * 2 * 4 * 4
  expected = [block, block] if "stages" in sizes else [block, block]
  assert [estimate[d] for d in cpus] == expected


@pytest.mark.parametrize("strategy, values", [
    ("pipeline", {"num_stages": 2}),
    ("tensor_parallel", {"tensor_parallel": 2}),
])
def test_plan_only_shows_the_kv_cache_of_the_caches_made(gpt, strategy,
                                                         values):
  from tfmgpu import strategies  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import plan as plan_lib  # pylint: disable=g-import-not-at-top
  distribution = strategies.lookup(strategy)
  options = distribution.options(**values)
  text = distribution.plan_text(gpt, options, global_batch_size=4,
                                optimizer="adam", input_shape=(24,))
  assert "the global batch size (4 rows) at the sequence length (24 " \
      "positions)" in text
  layout = distribution.layout_of(options)
  cpus = [devices_lib.canonical_device(d)
          for d in tfmgpu.list_devices("CPU")][:layout.num_devices]
  made = _made(placed_gen.placed_adapter(hybrid.build_layout(
      gpt, layout, devices=cpus)), 4, 24)
  section = text[text.index("Generation:"):].splitlines()
  rows = {line.split()[0]: line.split() for line in section
          if line.startswith("/device:")}
  for device in cpus:  # device, weights (2 words), KV cache (2), total.
    assert " ".join(rows[device][3:5]) == plan_lib._fmt_bytes(  # pylint: disable=protected-access
        made[device]), (device, rows[device])


def test_plan_only_has_no_kv_cache_for_other_models():
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((4,))
  mlp = keras.Model(inputs, keras.layers.Dense(3)(inputs))
  assert kv_cache.plan_section(mlp, None, batch=4, context=8) is None
