"""Strings given to a model that takes none are refused before any step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.parallel import StagedModel
from tfmgpu.parallel import partition
from tfmgpu.training.loop import Trainer

keras_hub = pytest.importorskip("keras_hub")

_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "dog",
          "sat", "on", "mat", "a", "ran"]
_TEXTS = np.array(["the cat sat", "a dog ran on the mat", "the mat", "a cat"])
_LABELS = np.array([0, 1, 0, 1], np.int32)


def _classifier():
  keras.utils.set_random_seed(0)
  preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
      keras_hub.tokenizers.BertTokenizer(vocabulary=_VOCAB), sequence_length=8)
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=len(_VOCAB), num_layers=1, num_heads=2, hidden_dim=8,
      intermediate_dim=16, max_sequence_length=8, dropout=0.0)
  return keras_hub.models.BertTextClassifier(
      backbone, num_classes=2, dropout=0.0, preprocessor=preprocessor)


_PREPROCESS = r"x = model.preprocessor\(x\).*dataset.map\(model.preprocessor\)"


@pytest.mark.parametrize("given", ["arrays", "dataset"])
def test_a_task_given_text_names_its_preprocessor_before_training(given):
  """The Trainer failed in the traced step with keras_hub's 'Use
  model.predict(x), model.fit(x, y) ...', which the user had called."""
  model = _classifier()
  trainer = Trainer(model, optimizer="sgd", verbose=0, loss=keras.losses.
                    SparseCategoricalCrossentropy(from_logits=True))
  data = ((_TEXTS, _LABELS) if given == "arrays" else (
      tf.data.Dataset.from_tensor_slices((_TEXTS, _LABELS)).batch(2), None))
  where = "x" if given == "arrays" else r"x's elements\[0\]"
  with pytest.raises(TypeError, match=rf"{where} holds strings, but model "
                     rf"'{model.name}' takes inputs of dtype int32.*{_PREPROCESS}"):
    trainer.fit(*data, global_batch_size=2 if given == "arrays" else None)
  with pytest.raises(TypeError, match=_PREPROCESS):
    trainer.evaluate(_TEXTS, _LABELS, global_batch_size=2)


def test_predict_and_a_splits_fit_refuse_text_by_name(cpu_devices):
  """`tfmgpu.predict` failed as the Trainer did; a split's Keras `fit`
  with 'Invalid dtype: str864'."""
  model = _classifier()
  with pytest.raises(TypeError, match=_PREPROCESS):
    tfmgpu.predict(model, _TEXTS, batch_size=2)
  staged = StagedModel(model, partition.plan_stages(
      model, 2, devices=cpu_devices[:2]))
  staged.compile(optimizer="sgd", loss=keras.losses.
                 SparseCategoricalCrossentropy(from_logits=True))
  for call in (lambda: staged.fit(_TEXTS, _LABELS, verbose=0),
               lambda: staged.predict(_TEXTS, verbose=0),
               lambda: tfmgpu.predict(staged, _TEXTS, batch_size=2)):
    with pytest.raises(TypeError, match=r"holds strings, .* int32.*"
                       r"task.preprocessor\(x\)"):
      call()
  x = {k: np.asarray(v) for k, v in model.preprocessor(_TEXTS).items()}
  np.testing.assert_allclose(tfmgpu.predict(staged, x, batch_size=2),
                             model(x), atol=1e-6)  # Preprocessed: taken.


def test_a_model_taking_strings_is_given_them():
  lookup = keras.layers.StringLookup(vocabulary=["cat", "dog"])
  words = keras.Input((1,), dtype="string")
  model = keras.Model(words, keras.layers.Dense(2)(
      keras.ops.cast(lookup(words), "float32")))
  x = np.array([["cat"], ["dog"], ["bird"], ["cat"]])
  np.testing.assert_allclose(tfmgpu.predict(model, x, batch_size=2),
                             model(tf.constant(x)), atol=1e-6)
