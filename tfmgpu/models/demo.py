"""Demo models deep enough to split into 2-8 stages.

Builders follow the model registry's signature
`fn(input_shape: tuple, num_classes: int, **kw) -> keras.Model`; outputs are
logits (no softmax) from a float32 layer, so they stay float32 under mixed
precision. Layer names are stable so split points can name them.

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

from tfmgpu._lazy import LazyModule
from tfmgpu.models.registry import logits_layer
from tfmgpu.models.registry import register_model

keras = LazyModule("keras")


@register_model("deep_mlp", "Eight hidden layers of 256 units: deep enough "
                "to split into 2-8 stages (model/pipeline parallelism).",
                blocks=lambda size: 10)
def deep_mlp(input_shape: tuple, num_classes: int, *, depth: int = 8,
             width: int = 256, name: str = "deep_mlp") -> "keras.Model":
  """A chain of `depth` ReLU Dense layers: every layer boundary is a cut point.

  Layers are named `flatten` (only for inputs with more than one axis),
  `hidden_0` .. `hidden_{depth-1}` and `logits`.

  Args:
    input_shape: shape of one example, e.g. `(28, 28)` or `(64,)`.
    num_classes: number of logits.
    depth: number of hidden layers. Defaults to `8`.
    width: units per hidden layer. Defaults to `256`.
    name: model name. Defaults to `"deep_mlp"`.

  Returns:
    A built Sequential model.
  """
  _check_positive(num_classes=num_classes, depth=depth, width=width)
  layers = [keras.Input(tuple(input_shape), name="inputs")]
  if len(input_shape) > 1:
    layers.append(keras.layers.Flatten(name="flatten"))
  layers += [keras.layers.Dense(width, activation="relu", name=f"hidden_{i}")
             for i in range(depth)]
  layers.append(logits_layer(num_classes))
  return keras.Sequential(layers, name=name)


@register_model("small_resnet", "A small convolutional ResNet (residual "
                "blocks are never cut inside).", blocks=lambda size: 34)
def small_resnet(input_shape: tuple, num_classes: int, *, blocks: int = 4,
                 filters: int = 16, name: str = "small_resnet"
                 ) -> "keras.Model":
  """A functional ResNet: a stem, `blocks` residual blocks, a classifier.

  Each residual block (`block{i}_conv1`, `block{i}_bn1`, `block{i}_relu1`,
  `block{i}_conv2`, `block{i}_bn2`, `block{i}_add`, `block{i}_out`) can only be
  cut at its ends: inside it, the shortcut and the main path both cross. Every
  second block halves the resolution and doubles the filters, with a 1x1
  projection shortcut (`block{i}_proj`).

  Args:
    input_shape: `(height, width, channels)`.
    num_classes: number of logits.
    blocks: number of residual blocks. Defaults to `4`.
    filters: filters of the stem and first blocks. Defaults to `16`.
    name: model name. Defaults to `"small_resnet"`.

  Returns:
    A built functional model.
  """
  _check_positive(num_classes=num_classes, blocks=blocks, filters=filters)
  if len(input_shape) != 3:
    raise ValueError(f"input_shape={tuple(input_shape)} must be (height, "
                     "width, channels) for small_resnet; use deep_mlp for "
                     "flat inputs.")
  L = keras.layers
  inputs = keras.Input(tuple(input_shape), name="inputs")
  x = L.Conv2D(filters, 3, padding="same", use_bias=False, name="stem_conv")(
      inputs)
  x = L.BatchNormalization(name="stem_bn")(x)
  x = L.Activation("relu", name="stem_relu")(x)
  for i in range(blocks):
    downsample = i > 0 and i % 2 == 0
    if downsample:
      filters *= 2
    stride = 2 if downsample else 1
    shortcut = x
    if downsample:
      shortcut = L.Conv2D(filters, 1, strides=2, use_bias=False,
                          name=f"block{i}_proj")(x)
    y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                 name=f"block{i}_conv1")(x)
    y = L.BatchNormalization(name=f"block{i}_bn1")(y)
    y = L.Activation("relu", name=f"block{i}_relu1")(y)
    y = L.Conv2D(filters, 3, padding="same", use_bias=False,
                 name=f"block{i}_conv2")(y)
    y = L.BatchNormalization(name=f"block{i}_bn2")(y)
    x = L.Add(name=f"block{i}_add")([shortcut, y])
    x = L.Activation("relu", name=f"block{i}_out")(x)
  x = L.GlobalAveragePooling2D(name="pool")(x)
  outputs = logits_layer(num_classes)(x)
  return keras.Model(inputs, outputs, name=name)


def _check_positive(**values: int) -> None:
  for key, value in values.items():
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{key}={value!r} must be a positive int.")
