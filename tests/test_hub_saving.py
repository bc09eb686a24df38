"""A trained keras_hub Llama is saved servable: keras_hub 0.32's
`LlamaTransformerDecoder.get_config` raises (`rope_scaling_factor`), so the
placement saves the model unsplit, its backbone rebuilt from the backbone's
own config; the `.keras` file loads and generates the placed model's
tokens."""

import warnings

import numpy as np
import pytest

import tfmgpu
from tfmgpu import inference
from tfmgpu import models
from tfmgpu import strategies
from tfmgpu.parallel import hybrid

pytest.importorskip("keras_hub")


def test_a_placed_llama_saves_as_keras_and_generates_its_tokens(tmp_path):
  wrapper = models.build_model("llama", input_shape=(16,), num_classes=64,
                               size="tiny", seed=0)
  placed = hybrid.build_layout(wrapper, hybrid.Layout(stages=2, tensor=2),
                               devices=tfmgpu.list_devices("CPU")[:4])
  # Weights that a fresh build does not have: the file must carry them.
  for variable in placed.trainable_variables:
    variable.assign(variable + 0.01)
  path = strategies.lookup("pipeline").save_model(
      placed, str(tmp_path / "model.keras"))
  loaded = inference.load_model(path)
  ids = np.random.RandomState(0).randint(1, 64, (2, 4)).astype(np.int32)
  want = tfmgpu.generate(placed, ids, max_new_tokens=4)["token_ids"]
  got = tfmgpu.generate(loaded, ids, max_new_tokens=4)["token_ids"]
  np.testing.assert_array_equal(got, want)
  wide = np.pad(ids, [(0, 0), (0, 12)])
  np.testing.assert_allclose(loaded.predict(wide, verbose=0),
                             placed.predict(wide, verbose=0), atol=1e-5)


def test_a_saved_llama_loads_without_keras_optimizer_warning(tmp_path):
  """A new user's trial: every load of a run's model.keras warned
  "Skipping variable loading for optimizer 'adam', because it has 2
  variables whereas the saved optimizer has 0": the inner task's own
  compile, which serving never uses, read as lost state."""
  wrapper = models.build_model("llama", input_shape=(16,), num_classes=64,
                               size="tiny", seed=0)
  path = str(tmp_path / "plain.keras")
  wrapper.save(path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = inference.load_model(path)
  assert not [w for w in caught if "Skipping variable loading" in str(
      w.message)]
  for a, b in zip(loaded.get_weights(), wrapper.get_weights()):
    np.testing.assert_array_equal(a, b)
