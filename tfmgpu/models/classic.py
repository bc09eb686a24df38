"""The classic small models: the 28x28 digit convnet and a two-layer MLP.

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

from tfmgpu._lazy import LazyModule
from tfmgpu.models.registry import logits_layer
from tfmgpu.models.registry import register_model

keras = LazyModule("keras")

# The smallest height and width convnet's two valid 5x5 convolutions and
# two 2x2 poolings leave a pixel of: 16 -> 12 -> 6 -> 2 -> 1.
CONVNET_MIN_SIZE = 16


@register_model("convnet", "Classic 28x28 digit net: Conv(10,5)-pool-"
                "Conv(20,5)-pool-Dense(50)-Dense(10).",
                blocks=lambda size: 7)
def convnet(input_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
  """The classic digit convnet (LeNet-like), as a Sequential model.

  `input_shape` `(height, width)` (grey images without a channel axis, as
  a float npz's `(n, H, W)` arrays) gets one in the model (a `Reshape`).

  Raises:
    ValueError: `input_shape` is not an image's, or one smaller than
      `CONVNET_MIN_SIZE` a side, said for the user (Keras named only a
      layer's `ndim`, or a convolution's "output size would be zero").
  """
  if len(input_shape) not in (2, 3):
    raise ValueError(
        f"model 'convnet' takes images of shape (height, width, channels) "
        f"or (height, width); the data's examples have input_shape="
        f"{tuple(input_shape)}. Choose a model for this data (--model=mlp "
        "for vectors, gpt for token sequences).")
  if min(input_shape[:2]) < CONVNET_MIN_SIZE:
    raise ValueError(
        f"model 'convnet' takes images of at least {CONVNET_MIN_SIZE}x"
        f"{CONVNET_MIN_SIZE} pixels (two 5x5 convolutions and two 2x2 "
        f"poolings); the data's examples are {input_shape[0]}x"
        f"{input_shape[1]} (input_shape={tuple(input_shape)}). Choose a "
        "model that takes them: --model=mlp or small_resnet, or resnet50 / "
        "mobilenet_v2, which pad small images.")
  layers = keras.layers
  grey = ([layers.Reshape((*input_shape, 1), name="channel")]
          if len(input_shape) == 2 else [])
  return keras.Sequential([
      keras.Input(input_shape), *grey,
      layers.Conv2D(10, 5, activation="relu", name="conv1"),
      layers.MaxPooling2D(2, name="pool1"),
      layers.Conv2D(20, 5, activation="relu", name="conv2"),
      layers.MaxPooling2D(2, name="pool2"),
      layers.Flatten(name="flatten"),
      layers.Dense(50, activation="relu", name="fc1"),
      logits_layer(num_classes),
  ], name="convnet")


@register_model("mlp", "Two hidden layers of 256 units.",
                blocks=lambda size: 4)
def mlp(input_shape: tuple[int, ...], num_classes: int, *,
        width: int = 256, depth: int = 2) -> "keras.Model":
  """Flatten, `depth` ReLU Dense layers of `width` units, then the logits."""
  layers = keras.layers
  stack = [keras.Input(input_shape), layers.Flatten(name="flatten")]
  stack += [layers.Dense(width, activation="relu", name=f"dense{i}")
            for i in range(depth)]
  return keras.Sequential(stack + [logits_layer(num_classes)], name="mlp")
