"""Keras Applications as registry models: `resnet50`, `mobilenet_v2`,
`efficientnet_b0`, with random weights (nothing is downloaded).

Each builder takes the image shape of the data, `(height, width, channels)`
(any channel count: the weights are random), and builds the application's
layers on that input (`input_tensor=`, so that its graph is flat and every
layer is a place the partitioner can cut), then global average pooling and
`logits_layer(num_classes)`. Images smaller than the applications' minimum
of 32 pixels a side are zero-padded to it by a `pad_to_min_size` layer
(28x28 digits become 32x32).

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

from typing import Any, Callable

from tfmgpu._lazy import LazyModule
from tfmgpu.models.registry import logits_layer
from tfmgpu.models.registry import register_model

keras = LazyModule("keras")

# The smallest height and width Keras Applications accept.
MIN_SIZE = 32


def _image_shape(name: str, input_shape: Any) -> tuple[int, int, int]:
  """`input_shape` as `(height, width, channels)`, or a ValueError."""
  shape = tuple(input_shape) if isinstance(input_shape, (list, tuple)) else ()
  if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
    raise ValueError(
        f"model {name!r} takes images: input_shape=(height, width, channels) "
        f"of positive ints, got input_shape={input_shape!r}. Use an image "
        "dataset (e.g. --dataset=digits or --dataset=synthetic).")
  return shape


def _padding(size: int) -> tuple[int, int]:
  """Zeros before and after an axis of `size` to reach `MIN_SIZE`."""
  missing = max(MIN_SIZE - size, 0)
  return missing // 2, missing - missing // 2


def build_application(application: Callable[..., Any], name: str,
                      input_shape: Any, num_classes: int, **options: Any
                      ) -> "keras.Model":
  """A Keras Application with random weights, on `input_shape`, ending in
  global average pooling and float32 logits.

  Args:
    application: e.g. `keras.applications.ResNet50`.
    name: the model's name.
    input_shape: `(height, width, channels)` of one example; smaller than
      32x32 is zero-padded (layer `pad_to_min_size`).
    num_classes: number of logits.
    **options: passed to `application` (e.g. `alpha=` for MobileNetV2).

  Returns:
    A functional model whose layers are the application's own, flat.

  Raises:
    ValueError: `input_shape` is not an image shape, or `num_classes` is not
      a positive int.
  """
  height, width, channels = _image_shape(name, input_shape)
  if not isinstance(num_classes, int) or num_classes < 1:
    raise ValueError(f"model {name!r} needs num_classes, a positive int; "
                     f"got num_classes={num_classes!r}.")
  inputs = keras.Input((height, width, channels), name="image")
  x = inputs
  pads = (_padding(height), _padding(width))
  if any(sum(p) for p in pads):
    x = keras.layers.ZeroPadding2D(pads, name="pad_to_min_size")(x)
  base = application(include_top=False, weights=None, input_tensor=x,
                     pooling="avg", **options)
  return keras.Model(inputs, logits_layer(num_classes)(base.output),
                     name=name)


@register_model("resnet50", "Keras Applications ResNet50, random weights "
                "(about 24M parameters; images padded to >= 32x32).")
def resnet50(input_shape: tuple, num_classes: int, *,
             name: str = "resnet50") -> "keras.Model":
  """`keras.applications.ResNet50` (random weights) on `input_shape`."""
  return build_application(keras.applications.ResNet50, name, input_shape,
                           num_classes)


@register_model("mobilenet_v2", "Keras Applications MobileNetV2, random "
                "weights (2.3M parameters; images padded to >= 32x32).")
def mobilenet_v2(input_shape: tuple, num_classes: int, *, alpha: float = 1.0,
                 name: str = "mobilenet_v2") -> "keras.Model":
  """`keras.applications.MobileNetV2` (random weights) on `input_shape`."""
  return build_application(keras.applications.MobileNetV2, name,
                           input_shape, num_classes, alpha=alpha)


@register_model("efficientnet_b0", "Keras Applications EfficientNetB0, "
                "random weights (4.1M parameters; images padded to >= "
                "32x32).")
def efficientnet_b0(input_shape: tuple, num_classes: int, *,
                    name: str = "efficientnet_b0") -> "keras.Model":
  """`keras.applications.EfficientNetB0` (random weights) on `input_shape`."""
  return build_application(keras.applications.EfficientNetB0, name,
                           input_shape, num_classes)
