"""Vocabulary-parallel embeddings and logits: the token table split by
vocabulary rows (and the LM head by vocabulary columns) trains as one
device, the tied keras_hub head stays one weight, and each shard's lookup
and logits run on its device (read from the traced step)."""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest

from tfmgpu import _compat
from tfmgpu.parallel import hybrid
from tfmgpu.parallel import inspection
from tfmgpu.parallel import layout_maps
from tfmgpu.parallel import split_embedding
from tfmgpu.parallel import tensor

import test_gpt_parallel as gpt_tests  # pylint: disable=g-bad-import-order

VOCAB_SPLIT = {r"^token_embedding/embeddings$": 0}
PRODUCTS = ("MatMul", "BatchMatMulV2", "Einsum")


def _vocab_layers(placed):
  return [l for l in _compat.flatten_layers(placed.model)
          if isinstance(l, split_embedding.VocabParallelEmbedding)]


def test_gpt_trains_as_unsplit_with_its_vocabulary_split(cpu_devices):
  x, y = gpt_tests._data()  # pylint: disable=protected-access
  reference = gpt_tests._gpt()  # pylint: disable=protected-access
  want, _ = gpt_tests._train(reference, x, y, keras.optimizers.SGD(0.1))  # pylint: disable=protected-access
  placed = hybrid.build_layout(
      gpt_tests._gpt(), hybrid.Layout(tensor=2), devices=cpu_devices[:2],  # pylint: disable=protected-access
      rules=tensor.GPT_RULES,
      layout_map=dict(VOCAB_SPLIT, **{r"^logits/kernel$": 1}))
  assert len(_vocab_layers(placed)) == 1
  got, step = gpt_tests._train(None, x, y, keras.optimizers.SGD(0.1),  # pylint: disable=protected-access
                               split=placed)
  np.testing.assert_allclose(got, want, atol=1e-5)
  out = gpt_tests._gpt(seed=7)  # pylint: disable=protected-access
  placed.copy_weights_to(out)
  for a, b in zip(out.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-5)
  ops = inspection.op_placements(step)
  for t in range(2):
    lookups = {p.device for p in ops if f"token_embedding_shard{t}" in p.name
               and "Gather" in p.type}
    logits = {p.device for p in ops if f"logits_shard{t}" in p.name
              and p.type in PRODUCTS}
    assert lookups == logits == {cpu_devices[t]}, (t, lookups, logits)


@pytest.fixture(scope="module")
def matrix():
  pytest.importorskip("keras_hub")
  spec = importlib.util.spec_from_file_location(
      "hub_matrix", pathlib.Path(__file__).parents[2] / "scripts" /
      "hub_matrix.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_gpt2s_tied_head_splits_by_vocabulary_as_one_weight(matrix,
                                                            cpu_devices,
                                                            tmp_path):
  """GPT-2's LM head is its token embedding reversed: one split layer
  serves both ends, its table one weight, training as one device; the
  split model's `.keras` file loads back (its blocks unsplit)."""
  x, y, sw = matrix.data("gpt2")
  reference = matrix.build("gpt2")
  matrix.fit(reference, x, y, sw)
  model = matrix.build("gpt2")
  placed = hybrid.build_layout(
      model, hybrid.Layout(tensor=2), devices=cpu_devices[:2],
      layout_map=dict(layout_maps.HUB_PATH_RULES, **VOCAB_SPLIT))
  (vocab,) = _vocab_layers(placed)
  assert vocab.reversible and vocab.tie_weights
  np.testing.assert_allclose(
      placed.predict(x, batch_size=matrix.BATCH, verbose=0),
      model.predict(x, batch_size=matrix.BATCH, verbose=0), atol=1e-5)
  matrix.fit(placed, x, y, sw)
  out = matrix.build("gpt2", seed=7)
  placed.copy_weights_to(out)
  assert len(out.get_weights()) == len(reference.get_weights())
  for a, b in zip(out.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-5)
  placed.model.save(str(tmp_path / "gpt2.keras"))
  loaded = keras.saving.load_model(str(tmp_path / "gpt2.keras"))
  np.testing.assert_allclose(
      loaded.predict(x, batch_size=matrix.BATCH, verbose=0),
      placed.predict(x, batch_size=matrix.BATCH, verbose=0), atol=1e-6)
