"""`export_saved_model` of a causal LM adds a `generate` signature (prefill
+ decode loop in TF) whose greedy tokens equal `tfmgpu.generate`'s, for
any batch, prompt width and `max_new_tokens`; other models get none."""

import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import inference
from tfmgpu import models


def _prompts(vocab, lengths=(5, 2, 8), width=8):
  ids = np.random.RandomState(0).randint(1, vocab, (len(lengths), width))
  mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
  return {"token_ids": (ids * mask).astype(np.int32), "padding_mask": mask}


def _signature_equals_generate(model, vocab, tmp_path):
  path = inference.export_saved_model(model, str(tmp_path / "sm"))
  generate = tf.saved_model.load(path).signatures["generate"]
  for prompts, new in ((_prompts(vocab), 7), (_prompts(vocab, (3,), 4), 2)):
    out = generate(token_ids=tf.constant(prompts["token_ids"]),
                   padding_mask=tf.constant(prompts["padding_mask"]),
                   max_new_tokens=tf.constant(new))
    expected = tfmgpu.generate(model, prompts, max_new_tokens=new)
    for key in ("token_ids", "padding_mask"):
      np.testing.assert_array_equal(out[key].numpy(), expected[key])


def test_gpt_generate_signature_equals_tfmgpu_generate(tmp_path):
  """Equal tokens; and what `tfmgpu.generate` refuses, the signature
  refuses (a new user's left-padded "AB" continued from its padding)."""
  model = models.build_model("gpt", input_shape=(24,), num_classes=50,
                             seed=3)
  _signature_equals_generate(model, 50, tmp_path)
  generate = tf.saved_model.load(str(tmp_path / "sm")).signatures["generate"]
  refused = {"right-padded": ([[0, 0, 5, 6]], [[False, False, True, True]]),
             "at least one prompt token": ([[0, 0]], [[False, False]]),
             ">= 0": ([[5, -1, 7]], [[True] * 3]),
             "vocabulary of 50": ([[5, 50]], [[True, True]])}
  for said, (ids, mask) in refused.items():
    with pytest.raises(tf.errors.InvalidArgumentError, match=said):
      generate(token_ids=tf.constant(ids, tf.int32),
               padding_mask=tf.constant(mask), max_new_tokens=tf.constant(2))
  out = generate(token_ids=tf.constant([[5, 6, 0, -3]], tf.int32),  # Padding
                 padding_mask=tf.constant([[True, True, False, False]]),
                 max_new_tokens=tf.constant(2))  # ids are not read.
  assert out["token_ids"].shape == (1, 4)


def test_a_model_that_is_no_language_model_has_no_generate(tmp_path):
  model = models.build_model("mlp", input_shape=(8,), num_classes=3, seed=0)
  path = inference.export_saved_model(model, str(tmp_path / "sm"))
  assert "generate" not in tf.saved_model.load(path).signatures


@pytest.mark.parametrize("name", ["gpt2"])  # Llama passes too (3x slower).
def test_keras_hub_generate_signature(name, tmp_path):
  keras_hub = pytest.importorskip("keras_hub")
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  if name == "gpt2":
    lm = keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=32), preprocessor=None)
  else:
    lm = keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32),
                                        preprocessor=None)
  _signature_equals_generate(lm, 64, tmp_path)
