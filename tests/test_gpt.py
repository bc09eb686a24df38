"""The `gpt` model: shapes, causality, the padding mask, parameter counts,
saving, and the `model_size` setting (checked before TensorFlow loads)."""

from __future__ import annotations

import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from tfmgpu import models
from tfmgpu.config import TrainConfig
from tfmgpu.models import gpt as gpt_lib

T = 16
MASKED = {"tokens": (T,), "padding_mask": (T,)}


def _build(input_shape=(T,), **kw):
  return models.build_model("gpt", input_shape=input_shape, num_classes=256,
                            seed=0, **kw)


@pytest.fixture(scope="module")
def plain():
  return _build()


@pytest.fixture(scope="module")
def masked():
  return _build(MASKED)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, 256, (3, T)).astype(np.int32)


def test_tiny_builds_with_the_named_layers_and_float32_logits(plain, tokens):
  assert [i.name for i in plain.inputs] == ["tokens"]
  assert plain.inputs[0].dtype == "int32"
  logits = plain(tokens)
  assert tuple(logits.shape) == (3, T, 256) and logits.dtype == "float32"
  names = [layer.name for layer in plain.layers]
  expected = ["tokens", "token_embedding", "position_embedding"]
  for i in range(2):
    expected += [f"block{i}_{n}" for n in ("ln1", "attention", "add1", "ln2",
                                           "mlp_up", "mlp_down", "add2")]
  assert names == expected + ["final_ln", "logits"]


def test_a_token_changes_no_logits_before_it(plain, tokens):
  before = np.asarray(plain(tokens))
  for t in (0, 7, T - 1):
    changed = tokens.copy()
    changed[:, t] = (changed[:, t] + 1) % 256
    after = np.asarray(plain(changed))
    np.testing.assert_array_equal(after[:, :t], before[:, :t])
    assert np.abs(after[:, t:] - before[:, t:]).max() > 1e-4


def test_the_padding_mask_is_read_by_every_block(masked, plain, tokens):
  assert sorted(i.name for i in masked.inputs) == ["padding_mask", "tokens"]
  mask_layer = masked.get_layer("attention_mask")
  readers = {node.operation.name for node in
             mask_layer.output._keras_history.operation._outbound_nodes}
  assert readers == {"block0_attention", "block1_attention"}
  ones = np.ones_like(tokens)
  masked.set_weights(plain.get_weights())  # Same weights, same order.
  np.testing.assert_allclose(
      masked({"tokens": tokens, "padding_mask": ones}), plain(tokens),
      atol=1e-6)
  padded = ones.copy()
  padded[:, :4] = 0
  a = np.asarray(masked({"tokens": tokens, "padding_mask": ones}))
  b = np.asarray(masked({"tokens": tokens, "padding_mask": padded}))
  assert np.abs(a[:, 4:] - b[:, 4:]).max() > 1e-3  # The mask changes them.
  assert np.isfinite(b).all()
  # Padded tokens are hidden: changing them changes no real position.
  other = tokens.copy()
  other[:, :4] = (other[:, :4] + 5) % 256
  c = np.asarray(masked({"tokens": other, "padding_mask": padded}))
  np.testing.assert_allclose(c[:, 4:], b[:, 4:], atol=1e-5)


@pytest.mark.parametrize("size,overrides", [
    ("tiny", {}), ("tiny", {"num_layers": 3, "mlp_ratio": 2}),
    ("mini", {"num_layers": 1})])
def test_parameter_count_matches_the_built_model(size, overrides):
  shape = gpt_lib.resolve_size(size, **overrides)
  model = _build(size=size, **overrides)
  assert model.count_params() == gpt_lib.parameter_count(shape, 256, T)


def test_gpt2_sizes_count_as_gpt2():
  # GPT-2's published count ties the logits to the token embedding.
  assert gpt_lib.parameter_count("gpt2_small", 50257, 1024,
                                 tied=True) == 124_439_808
  untied = gpt_lib.parameter_count("gpt2_small", 50257, 1024)
  assert untied == 124_439_808 + 768 * 50257 + 50257
  assert gpt_lib.parameter_count("gpt2_small", 256, 1024) == pytest.approx(
      86e6, rel=0.01)
  assert gpt_lib.parameter_count("gpt2_medium", 50257, 1024,
                                 tied=True) == pytest.approx(355e6, rel=0.01)
  assert gpt_lib.parameter_count("gpt2_xl", 50257, 1024,
                                 tied=True) == pytest.approx(1.558e9, rel=0.01)


def test_saved_gpt_loads_with_the_custom_objects(masked, tokens, tmp_path):
  path = str(tmp_path / "gpt.keras")
  masked.save(path)
  loaded = keras.saving.load_model(path, custom_objects=models.custom_objects())
  x = {"tokens": tokens, "padding_mask": np.ones_like(tokens)}
  np.testing.assert_allclose(loaded(x), masked(x), atol=1e-6)


@pytest.mark.parametrize("kw,message", [
    ({"size": "huge"}, "size='huge' is not a gpt size. Choose one of tiny, "
     "mini, gpt2_small"),
    ({"d_model": 30, "num_heads": 4}, "d_model=30 must be divisible by "
     "num_heads=4"),
    ({"layers": 2}, "unknown option(s) layers"),
    ({"input_shape": (T, 2)}, "must be (T,)"),
    ({"input_shape": {"tokens": (T,), "mask": (T,)}}, "must be tokens and "
     "padding_mask"),
])
def test_bad_shapes_are_named(kw, message):
  kw = dict(kw)
  input_shape = kw.pop("input_shape", (T,))
  with pytest.raises(ValueError, match=re.escape(message)):
    gpt_lib.gpt(input_shape, 256, **kw)


def test_model_size_reaches_the_builder_and_is_checked():
  config = TrainConfig(model="gpt", model_size="mini")
  assert config.model_options() == {"size": "mini"}
  assert TrainConfig(model="gpt").model_options() == {"size": "tiny"}
  with pytest.raises(ValueError, match=r"model_size='huge' is not a size of "
                     r"model 'gpt'. Choose one of tiny, mini, gpt2_small"):
    TrainConfig(model="gpt", model_size="huge")
  with pytest.raises(ValueError, match=r"model 'convnet' has no named sizes; "
                     r"drop model_size, or use a model that has them "
                     r"\(bert, gemma, gpt, gpt2, llama, qwen\)"):
    TrainConfig(model="convnet", model_size="tiny")


def test_model_size_flag_errors_come_before_tensorflow_loads():
  cli = [sys.executable, "-X", "importtime", "-m", "tfmgpu.train"]
  for args, message in (
      (["--model=gpt", "--model_size=huge"], "Choose one of tiny, mini"),
      (["--model_size=tiny"], "model 'convnet' has no named sizes")):
    run = subprocess.run([*cli, *args], capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 1 and message in run.stderr, run.stderr
    assert not re.search(r"\|\s*tensorflow$", run.stderr, re.M)
