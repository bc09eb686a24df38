"""Models by name: the registry, the classic digit models, the demo models.

* `registry`: `register_model`, `available_models`, `build_model` (under a
  mixed-precision dtype policy), `model_builder` (the one lookup: a name,
  or the user's `"module:function"`) and `logits_layer`, the float32 output
  layer every builder ends with;
* `classic`: `convnet` (the 28x28 digit net) and `mlp`;
* `demo`: `deep_mlp` and `small_resnet`, deep enough to split into 2-8
  stages (model and pipeline parallelism);
* `gpt`: `gpt`, a decoder-only transformer language model (named sizes
  `tiny` .. `gpt2_xl`, an optional padding mask read by every block);
* `applications`: `resnet50`, `mobilenet_v2`, `efficientnet_b0`: Keras
  Applications with random weights, on the data's image shape;
* `hub`: `gpt2`, `llama`, `gemma`, `qwen`: keras_hub causal LMs (size
  `tiny` and the published shapes; keras-hub imported on first build).

Importing this package registers every model and does not import TensorFlow
or Keras.
"""

from __future__ import annotations

from tfmgpu.models.registry import available_models
from tfmgpu.models.registry import build_model
from tfmgpu.models.registry import check_model
from tfmgpu.models.registry import check_model_size
from tfmgpu.models.registry import cuttable_blocks
from tfmgpu.models.registry import dataset_options
from tfmgpu.models.registry import default_dataset
from tfmgpu.models.registry import default_size
from tfmgpu.models.registry import dtype_policy
from tfmgpu.models.registry import logits_layer
from tfmgpu.models.registry import MIXED_PRECISION_POLICIES
from tfmgpu.models.registry import model_builder
from tfmgpu.models.registry import model_sizes
from tfmgpu.models.registry import ModelEntry
from tfmgpu.models.registry import ModelFn
from tfmgpu.models.registry import register_model
from tfmgpu.models.registry import unregister_model

# Registers the models, in this order (the CLI lists them so).
from tfmgpu.models import classic  # pylint: disable=g-bad-import-order
from tfmgpu.models import demo  # pylint: disable=g-bad-import-order
from tfmgpu.models import gpt  # pylint: disable=g-bad-import-order
from tfmgpu.models import applications  # pylint: disable=g-bad-import-order
from tfmgpu.models import hub  # pylint: disable=g-bad-import-order


def custom_objects() -> dict[str, type]:
  """The built-in models' custom Keras classes, by the names a saved model
  uses (`keras.saving.load_model(path, custom_objects=...)` in a fresh
  process). Imports Keras."""
  return dict(gpt.custom_objects())


__all__ = [
    "MIXED_PRECISION_POLICIES",
    "ModelEntry",
    "ModelFn",
    "applications",
    "available_models",
    "build_model",
    "check_model",
    "cuttable_blocks",
    "check_model_size",
    "classic",
    "custom_objects",
    "dataset_options",
    "default_dataset",
    "default_size",
    "demo",
    "dtype_policy",
    "gpt",
    "hub",
    "logits_layer",
    "model_builder",
    "model_sizes",
    "register_model",
    "unregister_model",
]
