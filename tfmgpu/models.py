"""Model registry: the demo models. Users bring their own `model_fn`.

A builder has the signature `fn(input_shape, num_classes, **options) ->
keras.Model` and returns *logits* (no softmax); the output layer computes in
float32 so that mixed precision never changes the loss's dtype.

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

from tfmgpu._lazy import LazyModule

keras = LazyModule("keras")

ModelFn = Callable[..., "keras.Model"]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  name: str
  description: str
  builder: ModelFn


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(name: str, description: str):
  """Decorator registering `builder(input_shape, num_classes, **kw)` as `name`."""
  def decorate(builder: ModelFn) -> ModelFn:
    if name in _REGISTRY:
      raise ValueError(f"model name {name!r} is already registered.")
    _REGISTRY[name] = ModelEntry(name, description, builder)
    return builder
  return decorate


def available_models() -> dict[str, str]:
  """Returns `{name: one-line description}` for every registered model."""
  return {n: e.description for n, e in _REGISTRY.items()}


MIXED_PRECISION_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


@contextlib.contextmanager
def dtype_policy(policy: str | None) -> Iterator[None]:
  """Sets Keras' global dtype policy for the block, then restores it.

  Models are built under this so that a mixed-precision run leaves no global
  state behind (a notebook can train float32 next).
  """
  if policy is None:
    yield
    return
  if policy not in MIXED_PRECISION_POLICIES:
    raise ValueError(f"mixed_precision={policy!r} is unknown. Choose one of "
                     f"{', '.join(MIXED_PRECISION_POLICIES)}.")
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(policy)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(previous)


def build_model(name_or_fn: str | ModelFn, *, input_shape: tuple[int, ...],
                num_classes: int, mixed_precision: str | None = None,
                seed: int | None = None, **options: Any) -> "keras.Model":
  """Builds a registered model (or calls a user's `model_fn`).

  Call it inside `strategy.scope()` (or a stage's device) so the variables
  are created where they belong.

  Args:
    name_or_fn: a registered name (see `available_models()`) or a callable
      `fn(input_shape, num_classes, **options)`.
    input_shape: shape of one example.
    num_classes: number of output logits.
    mixed_precision: Keras dtype policy name for the layers, or `None`.
    seed: seeds Keras' initialisers so that two builds give the same weights.
    **options: passed to the builder.

  Raises:
    ValueError: unknown name, listing the available ones.
  """
  if callable(name_or_fn):
    builder = name_or_fn
  elif name_or_fn in _REGISTRY:
    builder = _REGISTRY[name_or_fn].builder
  else:
    raise ValueError(f"Unknown model name={name_or_fn!r}. Available names: "
                     f"{', '.join(sorted(_REGISTRY))}.")
  if seed is not None:
    keras.utils.set_random_seed(seed)
  with dtype_policy(mixed_precision):
    return builder(tuple(input_shape), num_classes, **options)


def _logits(num_classes: int, name: str = "logits") -> "keras.layers.Layer":
  return keras.layers.Dense(num_classes, dtype="float32", name=name)


@register_model("convnet", "Classic 28x28 digit net: Conv(10,5)-pool-"
                "Conv(20,5)-pool-Dense(50)-Dense(10).")
def convnet(input_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
  layers = keras.layers
  return keras.Sequential([
      keras.Input(input_shape),
      layers.Conv2D(10, 5, activation="relu", name="conv1"),
      layers.MaxPooling2D(2, name="pool1"),
      layers.Conv2D(20, 5, activation="relu", name="conv2"),
      layers.MaxPooling2D(2, name="pool2"),
      layers.Flatten(name="flatten"),
      layers.Dense(50, activation="relu", name="fc1"),
      _logits(num_classes),
  ], name="convnet")


@register_model("mlp", "Two hidden layers of 256 units.")
def mlp(input_shape: tuple[int, ...], num_classes: int, *,
        width: int = 256, depth: int = 2) -> "keras.Model":
  layers = keras.layers
  stack = [keras.Input(input_shape), layers.Flatten(name="flatten")]
  stack += [layers.Dense(width, activation="relu", name=f"dense{i}")
            for i in range(depth)]
  return keras.Sequential(stack + [_logits(num_classes)], name="mlp")


@register_model("deep_mlp", "Eight hidden layers of 256 units: deep enough "
                "to split into 2-8 stages (model/pipeline parallelism).")
def deep_mlp(input_shape: tuple[int, ...], num_classes: int, **options
             ) -> "keras.Model":
  from tfmgpu.parallel import demo_models  # pylint: disable=g-import-not-at-top
  return demo_models.deep_mlp(input_shape, num_classes, **options)


@register_model("small_resnet", "A small convolutional ResNet (residual "
                "blocks are never cut inside).")
def small_resnet(input_shape: tuple[int, ...], num_classes: int, **options
                 ) -> "keras.Model":
  from tfmgpu.parallel import demo_models  # pylint: disable=g-import-not-at-top
  return demo_models.small_resnet(input_shape, num_classes, **options)
