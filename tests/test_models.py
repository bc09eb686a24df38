"""Model registry."""

import keras
import numpy as np
import pytest

from tfmgpu import models


def test_registry_holds_exactly_todays_names():
  assert set(models.available_models()) == {
      "convnet", "mlp", "deep_mlp", "small_resnet", "gpt", "resnet50",
      "mobilenet_v2", "efficientnet_b0", "gpt2", "llama", "gemma", "qwen",
      "bert"}


def test_convnet_is_the_classic_digit_net():
  m = models.build_model("convnet", input_shape=(28, 28, 1), num_classes=10)
  kinds = [type(l).__name__ for l in m.layers]
  assert kinds == ["Conv2D", "MaxPooling2D", "Conv2D", "MaxPooling2D",
                   "Flatten", "Dense", "Dense"]
  assert [m.layers[0].filters, m.layers[2].filters] == [10, 20]
  assert [m.layers[5].units, m.layers[6].units] == [50, 10]
  assert m.output_shape == (None, 10)


def test_a_builder_that_returns_no_model_or_gets_no_image_is_named():
  """Found by a new user: a model function without `return` failed later
  with "'NoneType' object has no attribute 'trainable_variables'", and
  convnet on vectors or tokens with Keras' "expected min_ndim=4"."""
  def build(input_shape, num_classes):
    keras.Sequential([keras.Input(input_shape), keras.layers.Dense(2)])
  with pytest.raises(ValueError, match=r"model='.*build' returned NoneType "
                     r"\('None'\); a model function must return a "
                     r"keras.Model \(build it and `return model`"):
    models.build_model(build, input_shape=(4,), num_classes=2)
  with pytest.raises(ValueError, match=r"model 'convnet' takes images of "
                     r"shape \(height, width, channels\) or \(height, width\); "
                     r"the data's examples have input_shape=\(64,\). Choose "
                     r"a model for this data"):
    models.build_model("convnet", input_shape=(64,), num_classes=2)
  grey = models.build_model("convnet", input_shape=(28, 28), num_classes=10)
  assert grey.layers[0].name == "channel" and grey.output_shape == (None, 10)


def test_convnet_names_images_too_small_for_it():
  """Found this session: the default model on the built-in `digits8x8`
  failed with Keras' "Computed output size would be zero or negative"."""
  with pytest.raises(ValueError, match=r"model 'convnet' takes images of at "
                     r"least 16x16 pixels .* the data's examples are 8x8 "
                     r"\(input_shape=\(8, 8, 1\)\). Choose a model that "
                     r"takes them: --model=mlp or small_resnet"):
    models.build_model("convnet", input_shape=(8, 8, 1), num_classes=10)
  smallest = models.build_model("convnet", input_shape=(16, 16, 1),
                                num_classes=10)
  assert smallest.output_shape == (None, 10)


def test_same_seed_same_weights():
  a = models.build_model("mlp", input_shape=(4,), num_classes=3, seed=7)
  b = models.build_model("mlp", input_shape=(4,), num_classes=3, seed=7)
  for wa, wb in zip(a.get_weights(), b.get_weights()):
    assert (wa == wb).all()


def test_mixed_precision_leaves_no_global_state():
  m = models.build_model("mlp", input_shape=(4,), num_classes=3,
                         mixed_precision="mixed_bfloat16")
  assert m.layers[1].dtype_policy.name == "mixed_bfloat16"
  assert m.layers[-1].dtype_policy.name == "float32"  # Logits in float32.
  assert keras.config.dtype_policy().name == "float32"


def test_user_model_fn_and_unknown_name():
  def tiny(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape),
                             keras.layers.Dense(num_classes)])
  assert models.build_model(tiny, input_shape=(2,), num_classes=5
                            ).output_shape == (None, 5)
  with pytest.raises(ValueError, match=r"Unknown model name='resnet9000'. "
                     r"Did you mean 'resnet50'\? Available names: "):
    models.build_model("resnet9000", input_shape=(2,), num_classes=2)
  with pytest.raises(ValueError, match=r"mixed_precision='fp8' is unknown"):
    models.build_model("mlp", input_shape=(2,), num_classes=2,
                       mixed_precision="fp8")


@pytest.mark.parametrize("name, size, shape, classes", [
    ("convnet", None, (28, 28, 1), 10), ("mlp", None, (28, 28, 1), 10),
    ("deep_mlp", None, (28, 28, 1), 10),
    ("small_resnet", None, (28, 28, 1), 10), ("gpt", "tiny", (32,), 256),
    ("gpt", "mini", (32,), 256)])
def test_declared_block_counts_are_the_built_models(name, size, shape,
                                                    classes):
  """The counts that refuse too many stages before TensorFlow loads
  (`models.cuttable_blocks`) are those the partitioner finds."""
  from tfmgpu.parallel import cost  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import graph  # pylint: disable=g-import-not-at-top
  options = {"size": size} if size else {}
  model = models.build_model(name, input_shape=shape, num_classes=classes,
                             seed=0, **options)
  blocks = cost.model_blocks(graph.ModelGraph(model))
  assert models.cuttable_blocks(name, size) == len(blocks)


def test_models_without_a_declared_count_are_checked_when_built():
  assert models.cuttable_blocks("resnet50") is None
  assert models.cuttable_blocks("path/to/file.py:build") is None


def test_a_classifier_without_class_labels_says_what_to_give():
  """Float labels give num_classes=None: Keras said `units=None`."""
  with pytest.raises(ValueError, match=r"num_classes=None: tfmgpu's built-in "
                     r"models end in one logit per class.*integer class labels"):
    models.build_model("mlp", input_shape=(4,), num_classes=None)
  assert models.build_model("mlp", input_shape=(4,),
                            num_classes=np.int64(3)).output_shape == (None, 3)
