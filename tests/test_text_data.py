"""`stdlib_text` (tfmgpu.datasets.text), its byte-unigram baseline, the
`bits_per_byte` / `perplexity` metrics, and a run's summary printing the
model's bits per byte next to the baseline."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import re

import keras
import numpy as np
import pytest

from tfmgpu import data
from tfmgpu import runs
from tfmgpu.datasets import text
from tfmgpu.config import TrainConfig
from tfmgpu.training import objectives
from tfmgpu.training import text_metrics


@pytest.fixture(scope="module")
def arrays():
  return data.load_dataset("stdlib_text", seq_len=32)


def test_the_bytes_are_the_listed_modules_in_order_and_hashed():
  source = text.source_bytes()
  expected = b"".join(
      open(os.path.join(text.stdlib_dir(), f"{m}.py"), "rb").read()
      for m in text.MODULES)
  assert source == expected and 300_000 < len(source) < 600_000
  if platform.python_version() not in text.SOURCE_SHA256:
    pytest.skip(f"no hash recorded for Python {platform.python_version()}")
  assert text.check_source_hash(source)
  assert (hashlib.sha256(source).hexdigest()
          == text.SOURCE_SHA256[platform.python_version()])


def test_another_pythons_bytes_warn_with_both_hashes_and_load(
    monkeypatch, caplog):
  monkeypatch.setattr(text, "SOURCE_SHA256", {"3.0.0": "ab" * 32})
  with caplog.at_level(logging.WARNING):
    loaded = data.load_dataset("stdlib_text", seq_len=32)
  digest = hashlib.sha256(text.source_bytes()).hexdigest()
  assert digest in caplog.text and "ab" * 32 in caplog.text
  assert "no hash is recorded for this version" in caplog.text
  assert len(loaded.x_train)


def test_windows_are_next_byte_pairs_and_the_split_is_fixed(arrays):
  raw = np.frombuffer(text.source_bytes(), np.uint8)
  cut = len(raw) - int(len(raw) * 0.1)
  assert arrays.num_classes == 256 and arrays.x_train.dtype == np.int32
  assert arrays.x_train.shape == ((cut - 1) // 32, 32)
  np.testing.assert_array_equal(arrays.x_train[:, 1:], arrays.y_train[:, :-1])
  np.testing.assert_array_equal(arrays.x_train.ravel(),
                                raw[:arrays.x_train.size])  # Non-overlapping.
  np.testing.assert_array_equal(arrays.y_train[-1, -1], raw[arrays.x_train.size])
  np.testing.assert_array_equal(arrays.x_test.ravel(),
                                raw[cut:cut + arrays.x_test.size])
  np.testing.assert_array_equal(arrays.y_test.ravel(),
                                raw[cut + 1:cut + 1 + arrays.y_test.size])
  again = data.load_dataset("stdlib_text", seq_len=32, seed=7)
  np.testing.assert_array_equal(again.x_test, arrays.x_test)
  np.testing.assert_array_equal(again.x_train, arrays.x_train)


def test_the_unigram_baseline_by_hand():
  train = np.array([0, 0, 1], np.uint8)  # Counts +1: 3, 2, then 1s.
  p0, p1, p2 = 3 / 259, 2 / 259, 1 / 259
  expected = -(math.log2(p0) + math.log2(p1) + math.log2(p2)) / 3
  assert text.unigram_bits_per_byte(train, np.array([0, 1, 2])) == (
      pytest.approx(expected, rel=1e-12))


def test_the_dataset_carries_its_baseline(arrays):
  (baseline,) = arrays.baselines
  raw = np.frombuffer(text.source_bytes(), np.uint8)
  cut = text.split_point(len(raw))
  assert (baseline.name, baseline.metric) == ("byte-unigram", "bits_per_byte")
  assert baseline.value == pytest.approx(
      text.unigram_bits_per_byte(raw[:cut], arrays.y_test))
  assert 4.0 < baseline.value < 5.0


def test_padding_mask_variants():
  ones = data.load_dataset("stdlib_text", seq_len=32, padding_mask="ones")
  assert set(ones.x_train) == {"tokens", "padding_mask"}
  assert ones.x_train["padding_mask"].min() == 1
  ragged = data.load_dataset("stdlib_text", seq_len=32, padding_mask="ragged")
  x, m = ragged.x_train["tokens"], ragged.x_train["padding_mask"]
  plain_x = ones.x_train["tokens"]
  pads = (m == 0).sum(axis=1)
  assert (pads[1::2] == 0).all() and (pads[::2] >= 1).all()
  assert (pads <= 16).all()
  for row in (0, 2, 4):
    k = pads[row]
    assert (m[row, :k] == 0).all() and (m[row, k:] == 1).all()
    assert (x[row, :k] == 0).all() and (ragged.y_train[row, :k] == 0).all()
    np.testing.assert_array_equal(x[row, k:], plain_x[row, :32 - k])
    np.testing.assert_array_equal(ragged.y_train[row, k:],
                                  ones.y_train[row, :32 - k])
  assert ragged.x_test["padding_mask"].min() == 1
  with pytest.raises(ValueError, match="padding_mask='left' is not one of "
                     "none, ones, ragged"):
    data.load_dataset("stdlib_text", padding_mask="left")


# ------------------------------------------------------------------ metrics

def _batch():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  y = rng.integers(0, 5, (2, 3)).astype(np.int32)
  return y, logits


def _hand_ce(y, logits):
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.take_along_axis(log_p, y[..., None], -1)[..., 0]


def test_bits_per_byte_and_perplexity_by_hand_and_against_keras():
  y, logits = _batch()
  ce = _hand_ce(y, logits)
  bpb, ppl = text_metrics.BitsPerByte(), text_metrics.Perplexity()
  for metric in (bpb, ppl):
    metric.update_state(y, logits)
  assert float(bpb.result()) == pytest.approx(ce.mean() / math.log(2), 1e-6)
  assert float(ppl.result()) == pytest.approx(math.exp(ce.mean()), 1e-6)
  keras_ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  assert float(bpb.result()) == pytest.approx(
      float(keras_ce(y, logits)) / math.log(2), 1e-6)
  assert [v.aggregation for v in bpb.variables] == ["sum", "sum"]
  weights = np.array([1.0, 0.0], np.float32)  # The second example is padding.
  weighted = text_metrics.BitsPerByte()
  weighted.update_state(y, logits, sample_weight=weights)
  assert float(weighted.result()) == pytest.approx(
      ce[0].mean() / math.log(2), 1e-6)


def test_metrics_by_name_sum_exactly_over_parts():
  y, logits = _batch()
  model = keras.Sequential([keras.Input((3, 5)), keras.layers.Identity()])
  objective = objectives.Objective(
      model, loss=None, metrics=["bits_per_byte", "perplexity"])
  assert objective.metric_names == ["bits_per_byte", "perplexity"]
  halves = [objective.metric_updates(y[i:i + 1], logits[i:i + 1])
            for i in (0, 1)]
  summed = {k: np.asarray(halves[0][k]) + np.asarray(halves[1][k])
            for k in halves[0]}
  whole = objective.results(objective.metric_updates(y, logits))
  assert objective.results(summed) == pytest.approx(whole, rel=1e-6)
  ce = _hand_ce(y, logits).mean()
  assert whole["bits_per_byte"] == pytest.approx(ce / math.log(2), 1e-6)


def test_metrics_read_probabilities_when_the_loss_does():
  y, logits = _batch()
  probabilities = keras.ops.softmax(logits).numpy()
  model = keras.Sequential([keras.Input((3, 5)), keras.layers.Identity()])
  want = _hand_ce(y, logits).mean() / math.log(2)
  for loss in ("sparse_categorical_crossentropy",
               keras.losses.SparseCategoricalCrossentropy()):
    objective = objectives.Objective(model, loss=loss,
                                     metrics=["bits_per_byte"])
    got = objective.results(objective.metric_updates(y, probabilities))
    assert got["bits_per_byte"] == pytest.approx(want, rel=1e-5)


def test_the_text_dataset_defaults_its_metrics():
  assert TrainConfig(dataset="stdlib_text").loss_and_metrics()[1] == [
      "bits_per_byte", "perplexity", "accuracy"]
  assert TrainConfig(dataset="stdlib_text",
                     metrics=("accuracy",)).loss_and_metrics()[1] == [
                         "accuracy"]
  assert TrainConfig(dataset="stdlib_text",
                     loss="mse").loss_and_metrics()[1] is None
  assert TrainConfig().loss_and_metrics()[1] is None


def test_a_run_prints_bits_per_byte_next_to_the_baseline(arrays, tmp_path):
  small = data.Arrays(arrays.name, arrays.x_train[:256], arrays.y_train[:256],
                      arrays.x_test[:64], arrays.y_test[:64], 256,
                      baselines=arrays.baselines)
  config = TrainConfig(strategy="default", model="gpt", dataset="stdlib_text",
                       epochs=1, global_batch_size=64, verbose=0,
                       model_dir=str(tmp_path))
  summary = runs.run_training(config, arrays=small)
  value = summary.test_metrics["bits_per_byte"]
  base = arrays.baselines[0].value
  assert value == pytest.approx(summary.test_loss / math.log(2), rel=1e-5)
  gap = base - value
  assert re.search(
      rf"test bits_per_byte\s+{value:.4f} \(byte-unigram baseline "
      rf"{base:.4f}; {abs(gap):.4f} {'below' if gap >= 0 else 'above'}\)",
      str(summary)), str(summary)
  assert "test loss / bits_per_byte / perplexity / accuracy" in str(summary)


def test_stdlib_modules_classifies_windows_of_the_same_text():
  from tfmgpu.datasets import stdlib_modules  # pylint: disable=g-import-not-at-top
  arrays = data.load_dataset("stdlib_modules", seq_len=32)
  assert arrays.num_classes == len(text.MODULES) == 12
  assert arrays.x_train.shape[1:] == (32,) and arrays.x_train.dtype == np.int32
  assert set(np.unique(arrays.y_test)) == set(range(12))
  assert not np.all(np.diff(arrays.y_train) >= 0)  # Shuffled.
  # The first validation window of each module is the start of its last 10%.
  for label, source in enumerate(text.module_sources()):
    cut = text.split_point(len(source))
    first = arrays.x_test[np.argmax(arrays.y_test == label)]
    assert bytes(first.astype(np.uint8)) == source[cut:cut + 32]
  assert 0.1 < stdlib_modules.majority_accuracy(arrays.y_train,
                                                arrays.y_test) < 0.3
  with pytest.raises(ValueError, match="seq_len=100000 is longer"):
    stdlib_modules.load(seq_len=100_000)
