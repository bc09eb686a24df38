"""The model registry: builders by name, built under a dtype policy.

A builder has the signature `fn(input_shape, num_classes, **options) ->
keras.Model` and returns *logits* (no softmax); its output layer
(`logits_layer`) computes in float32 so that mixed precision never changes
the loss's dtype. Users bring their own `model_fn`, `register_model` it, or
name it as `"package.module:function"` / `"path/to/file.py:function"`
(`--model=...`; see `tfmgpu.user_code`): it is called as
`function(input_shape, num_classes)`, where `input_shape` is the shape of
one example (for several inputs, the same dict/list nesting as the data's
`x`, e.g. `{"image": (28, 28, 1), "tabular": (56,)}`) and `num_classes` the
dataset's class count (`None` when its targets are not class indices).

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Iterator
from typing import Any, Callable

from tfmgpu import checks
from tfmgpu import user_code
from tfmgpu._lazy import LazyModule

keras = LazyModule("keras")

ModelFn = Callable[..., "keras.Model"]

# How a user's builder named by reference is called (checked before use).
USER_BUILDER_CALL = user_code.Call(
    args=((28, 28, 1), 10), shown="build(input_shape, num_classes)")


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """A registered builder, its one-line description and its named sizes
  (the values its `size=` option takes; empty: it has none).

  `dataset` is the registered dataset it trains on when the run names none
  (`None`: the run's default), and `dataset_options(size)` that dataset's
  options for a size (e.g. `gpt`'s sequence length).
  """
  name: str
  description: str
  builder: ModelFn
  sizes: tuple[str, ...] = ()
  dataset: str | None = None
  dataset_options: Callable[[str | None], dict] | None = None
  blocks: Callable[[str | None], int] | None = None


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(name: str, description: str, *,
                   sizes: tuple[str, ...] = (), dataset: str | None = None,
                   dataset_options: Callable[[str | None], dict] | None = None,
                   blocks: Callable[[str | None], int] | None = None):
  """Decorator registering `builder(input_shape, num_classes, **kw)` as `name`.

  Args:
    name: the registry key.
    description: one line for help text.
    sizes: the named sizes the builder's `size=` option takes
      (`--model_size`), its default first; empty for a builder without one.
    dataset: the registered dataset a run of this model reads when it
      names none (e.g. `gpt`: `stdlib_text`).
    dataset_options: `fn(size) -> options` of that dataset for a size
      (`None`: the size's default); pure Python, no TensorFlow.
    blocks: `fn(size) -> int`, the cuttable blocks of the built model at
      its default options (`tfmgpu.parallel.cost.model_blocks`: at most
      that many stages), so that too many stages are refused before
      TensorFlow loads; pure Python. `None`: known once built.
  """
  def decorate(builder: ModelFn) -> ModelFn:
    if name in _REGISTRY:
      raise ValueError(f"model name {name!r} is already registered.")
    _REGISTRY[name] = ModelEntry(name, description, builder, tuple(sizes),
                                 dataset, dataset_options, blocks)
    return builder
  return decorate


def cuttable_blocks(model: Any, size: str | None = None) -> int | None:
  """The cuttable blocks of registered `model` at `size` (its declared
  count), without building it; `None` for a model that declares none or
  for the user's own builder."""
  entry = _REGISTRY.get(model) if isinstance(model, str) else None
  if entry is None or entry.blocks is None:
    return None
  return entry.blocks(size)


def default_dataset(model: str, fallback: str) -> str:
  """The dataset a run of `model` reads when it names none: the model's
  own (`register_model(dataset=...)`), else `fallback`."""
  entry = _REGISTRY.get(model) if isinstance(model, str) else None
  return entry.dataset if entry is not None and entry.dataset else fallback


def dataset_options(model: str, size: str | None, dataset: str) -> dict:
  """The options `model` at `size` sets for `dataset`: its
  `dataset_options(size)` when `dataset` is the model's own, else none."""
  entry = _REGISTRY.get(model) if isinstance(model, str) else None
  if entry is None or entry.dataset != dataset or not entry.dataset_options:
    return {}
  return dict(entry.dataset_options(size))


def unregister_model(name: str) -> None:
  """Removes a registered model (tests and plugins that clean up)."""
  _REGISTRY.pop(name, None)


def available_models() -> dict[str, str]:
  """Returns `{name: one-line description}` for every registered model."""
  return {n: e.description for n, e in _REGISTRY.items()}


def check_model(name: str) -> None:
  """Checks a model setting without importing user code or TensorFlow.

  Args:
    name: a registered name, or a reference to a builder (`module:function`
      or `file.py:function`), whose module or file must exist and define it.

  Raises:
    ValueError: an unknown name (listing the registered ones) or a
      reference that cannot be used (`tfmgpu.user_code.UserCodeError`).
  """
  user_code.check_name("model", name, _REGISTRY, USER_BUILDER_CALL)


def model_sizes() -> dict[str, tuple[str, ...]]:
  """`{name: sizes}` of the registered models that have named sizes."""
  return {n: e.sizes for n, e in _REGISTRY.items() if e.sizes}


def default_size(name: str) -> str | None:
  """The size a registered model is built at when none is named (its
  first), or `None` for a model without named sizes."""
  entry = _REGISTRY.get(name) if isinstance(name, str) else None
  return entry.sizes[0] if entry is not None and entry.sizes else None


def check_model_size(name: str, size: str | None) -> None:
  """Checks a `model_size` setting without importing TensorFlow.

  Args:
    name: the model setting: a registered name, or a reference to the
      user's builder (which gets `size=` as is: its own check applies).
    size: the named size, or `None` (the builder's default).

  Raises:
    ValueError: a size the registered model does not have (listing its
      sizes), or a size for a registered model that has none.
  """
  if size is None or user_code.is_reference(name) or name not in _REGISTRY:
    return
  sizes = _REGISTRY[name].sizes
  if not sizes:
    raise ValueError(f"model_size={size!r} is given, but model {name!r} has "
                     "no named sizes; drop model_size, or use a model that "
                     f"has them ({', '.join(sorted(model_sizes()))}).")
  if size not in sizes:
    raise ValueError(f"model_size={size!r} is not a size of model {name!r}. "
                     f"Choose one of {', '.join(sizes)}.")


def model_builder(name_or_fn: str | ModelFn) -> ModelFn:
  """The builder a model setting names: the one lookup of names.

  Args:
    name_or_fn: a callable (returned as is), a registered name, or a
      reference to the user's `build(input_shape, num_classes)` (imported
      and its signature checked).

  Raises:
    ValueError: unknown name, listing the available ones; a reference that
      cannot be imported or called so (`tfmgpu.user_code.UserCodeError`).
  """
  if callable(name_or_fn):
    return name_or_fn
  if user_code.is_reference(name_or_fn):
    return user_code.load_function("model", name_or_fn, USER_BUILDER_CALL)
  if name_or_fn in _REGISTRY:
    return _REGISTRY[name_or_fn].builder
  hint = checks.did_you_mean(name_or_fn, _REGISTRY)
  raise ValueError(f"Unknown model name={name_or_fn!r}.{hint} Available names: "
                   f"{', '.join(sorted(_REGISTRY))}; or your own builder as "
                   f"{user_code.FORMS}.")


def _as_shape(shape: Any) -> Any:
  """One example's shape as a tuple; nested shapes (several inputs) keep
  their dict/list nesting, each leaf a tuple."""
  if isinstance(shape, dict):
    return {k: _as_shape(v) for k, v in shape.items()}
  if isinstance(shape, (list, tuple)) and shape and not all(
      isinstance(d, int) or d is None for d in shape):
    return [_as_shape(s) for s in shape]
  return tuple(shape)


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
    name_or_fn: a registered name (see `available_models()`), a callable
      `fn(input_shape, num_classes, **options)`, or a reference to one
      (`"package.module:function"`, `"path/to/file.py:function"`).
    input_shape: shape of one example; for several inputs, a dict or list
      of shapes (as the data's `x`).
    num_classes: number of output logits (`None` for targets that are not
      class indices).
    mixed_precision: Keras dtype policy name for the layers, or `None`.
    seed: seeds Keras' initialisers so that two builds give the same weights.
    **options: passed to the builder.

  Raises:
    ValueError: unknown name, listing the available ones; a reference that
      cannot be used (see `model_builder`); a builder that returned
      something other than a Keras model.
  """
  builder = model_builder(name_or_fn)
  if seed is not None:
    keras.utils.set_random_seed(seed)
  with dtype_policy(mixed_precision):
    model = builder(_as_shape(input_shape), num_classes, **options)
  if not isinstance(model, keras.Model):
    name = (name_or_fn if isinstance(name_or_fn, str)
            else getattr(name_or_fn, "__qualname__", repr(name_or_fn)))
    raise ValueError(
        f"model={name!r} returned {type(model).__name__} "
        f"({str(model)[:60]!r}); a model function must return a keras.Model "
        "(build it and `return model`: a missing return gives None).")
  return model


def logits_layer(num_classes: int, name: str = "logits"
                 ) -> "keras.layers.Layer":
  """The output layer every builder ends with: float32 logits, no softmax.

  Raises:
    ValueError: `num_classes` is not a positive integer (`None`: the
      labels are not class indices), said for the user.
  """
  if isinstance(num_classes, bool) or not isinstance(
      num_classes, numbers.Integral) or num_classes < 1:
    raise ValueError(
        f"num_classes={num_classes!r}: tfmgpu's built-in models end in one "
        "logit per class, and num_classes is max(y) + 1 for integer labels "
        "(None: the labels are not class indices, e.g. floats). Give integer "
        "class labels 0..K-1, or your own model for other targets "
        "(--model=path/to/file.py:build, with --loss=mse for values).")
  return keras.layers.Dense(int(num_classes), dtype="float32", name=name)
