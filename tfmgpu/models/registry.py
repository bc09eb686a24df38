"""The model registry: builders by name, built under a dtype policy.

A builder has the signature `fn(input_shape, num_classes, **options) ->
keras.Model` and returns *logits* (no softmax); its output layer
(`logits_layer`) computes in float32 so that mixed precision never changes
the loss's dtype. Users bring their own `model_fn` or `register_model` it.

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
  """A registered builder and its one-line description."""
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


def unregister_model(name: str) -> None:
  """Removes a registered model (tests and plugins that clean up)."""
  _REGISTRY.pop(name, None)


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


def logits_layer(num_classes: int, name: str = "logits"
                 ) -> "keras.layers.Layer":
  """The output layer every builder ends with: float32 logits, no softmax."""
  return keras.layers.Dense(num_classes, dtype="float32", name=name)
