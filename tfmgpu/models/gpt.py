"""`gpt`: a decoder-only transformer language model from Keras layers.

Token and learned position embeddings, `num_layers` pre-norm blocks of
causal multi-head attention and a GELU MLP (each with a residual add), a
final layer norm and float32 logits over the vocabulary. An optional
`padding_mask` input (1 = real token, 0 = padding) is read by every block's
attention, so it crosses every cut between pipeline stages.

Layer names are stable, so split points can name them: `token_embedding`,
`position_embedding`, then per block `i`: `block{i}_ln1`,
`block{i}_attention`, `block{i}_add1`, `block{i}_ln2`, `block{i}_mlp_up`,
`block{i}_mlp_down`, `block{i}_add2`; then `final_ln` and `logits`. With a
padding mask, `attention_mask` reshapes it to `(B, 1, T)` once. A real
token never attends to padding; a padded position whose visible keys are
all padding gets Keras' fully-masked softmax (uniform over every key), so
its logits carry no meaning: give its target no weight, or a fixed one.

`SIZES` holds the named shapes, from `tiny` (tests) to GPT-2's; the logits
layer is not tied to the token embedding (each stage owns its weights), so a
model holds `vocab * d_model + vocab` more parameters than GPT-2's tied
count (`parameter_count(..., tied=True)` gives GPT-2's published figure).

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tfmgpu._lazy import LazyModule
from tfmgpu.models.registry import logits_layer
from tfmgpu.models.registry import register_model

keras = LazyModule("keras")


@dataclasses.dataclass(frozen=True)
class GPTSize:
  """The shape of a `gpt`: blocks, width, heads, MLP width ratio, dropout."""
  num_layers: int
  d_model: int
  num_heads: int
  mlp_ratio: int = 4
  dropout: float = 0.0


SIZES: dict[str, GPTSize] = {
    "tiny": GPTSize(num_layers=2, d_model=32, num_heads=2),
    "mini": GPTSize(num_layers=4, d_model=128, num_heads=4),
    "gpt2_small": GPTSize(num_layers=12, d_model=768, num_heads=12),
    "gpt2_medium": GPTSize(num_layers=24, d_model=1024, num_heads=16),
    "gpt2_large": GPTSize(num_layers=36, d_model=1280, num_heads=20),
    "gpt2_xl": GPTSize(num_layers=48, d_model=1600, num_heads=25),
}
DEFAULT_SIZE = "tiny"

# The sequence length each size reads when a run names no dataset (the
# `stdlib_text` windows): short for the CPU sizes, GPT-2's context for its.
CONTEXTS: dict[str, int] = {"tiny": 64, "mini": 64, "gpt2_small": 1024,
                            "gpt2_medium": 1024, "gpt2_large": 1024,
                            "gpt2_xl": 1024}


def cuttable_blocks(size: str | None) -> int:
  """Cuttable blocks of a `gpt` of `size` (no dropout): the embeddings and
  the position add, 7 per transformer block, the final norm and logits."""
  return 7 * SIZES[size or DEFAULT_SIZE].num_layers + 4


def text_options(size: str | None) -> dict[str, int]:
  """`stdlib_text`'s options for a size: `{"seq_len": CONTEXTS[size]}`."""
  return {"seq_len": CONTEXTS.get(size or DEFAULT_SIZE, CONTEXTS[DEFAULT_SIZE])}


def resolve_size(size: str = DEFAULT_SIZE, **overrides: Any) -> GPTSize:
  """The shape `size` names, with `overrides` (any `GPTSize` field) applied.

  Raises:
    ValueError: an unknown size (listing the sizes), an unknown override,
      or a shape that does not hold (`d_model` not divisible by
      `num_heads`, a non-positive count, dropout outside [0, 1)).
  """
  if size not in SIZES:
    raise ValueError(f"size={size!r} is not a gpt size. Choose one of "
                     f"{', '.join(SIZES)}.")
  fields = {f.name for f in dataclasses.fields(GPTSize)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"gpt got unknown option(s) {', '.join(unknown)}; it "
                     f"takes size= and {', '.join(sorted(fields))}.")
  shape = dataclasses.replace(SIZES[size], **overrides)
  for key in ("num_layers", "d_model", "num_heads", "mlp_ratio"):
    value = getattr(shape, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{key}={value!r} must be a positive int.")
  if shape.d_model % shape.num_heads:
    raise ValueError(f"d_model={shape.d_model} must be divisible by "
                     f"num_heads={shape.num_heads}.")
  if not 0.0 <= shape.dropout < 1.0:
    raise ValueError(f"dropout={shape.dropout!r} must be in [0, 1).")
  return shape


def parameter_count(size: str | GPTSize, vocab: int, context: int, *,
                    tied: bool = False) -> int:
  """The number of weights of `gpt(size=size)`, counted without building it.

  Args:
    size: a name in `SIZES`, or a `GPTSize`.
    vocab: vocabulary size (`num_classes`): 256 for bytes, 50257 for GPT-2.
    context: sequence length `T` (rows of the position embedding).
    tied: count the logits as GPT-2's: the token embedding's transpose, no
      bias (its published 124,439,808 for `gpt2_small`, vocab 50257,
      context 1024). tfmgpu's `gpt` is untied: leave it `False` to match
      `model.count_params()`.

  Returns:
    The parameter count.
  """
  shape = resolve_size(size) if isinstance(size, str) else size
  d, m = shape.d_model, shape.d_model * shape.mlp_ratio
  block = (2 * d            # ln1
           + 4 * (d * d + d)  # query, key, value, output projections
           + 2 * d          # ln2
           + d * m + m      # mlp_up
           + m * d + d)     # mlp_down
  logits = 0 if tied else d * vocab + vocab
  return vocab * d + context * d + shape.num_layers * block + 2 * d + logits


_LAYER_CLASSES: dict[str, type] = {}


def position_embedding_class() -> type:
  """`PositionEmbedding`, defined (and registered with Keras) on first use.

  Call it before `keras.saving.load_model` of a saved `gpt` in a fresh
  process (the class lives here so that importing this module does not
  import Keras).
  """
  if "PositionEmbedding" not in _LAYER_CLASSES:
    _LAYER_CLASSES["PositionEmbedding"] = _define_position_embedding()
  return _LAYER_CLASSES["PositionEmbedding"]


def custom_objects() -> dict[str, type]:
  """The custom layers of `gpt`, for `keras.saving.custom_object_scope`."""
  cls = position_embedding_class()
  return {"PositionEmbedding": cls, "tfmgpu>PositionEmbedding": cls}


def _define_position_embedding() -> type:
  """Defines the layer adding one learned vector per position."""

  @keras.saving.register_keras_serializable(package="tfmgpu")
  class PositionEmbedding(keras.layers.Layer):
    """Adds a learned `(max_length, d_model)` table to `(B, T, d_model)`."""

    def __init__(self, max_length: int, initializer: Any = "glorot_uniform",
                 **kwargs):
      super().__init__(**kwargs)
      self.max_length = int(max_length)
      self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
      self.embeddings = self.add_weight(
          name="embeddings", shape=(self.max_length, input_shape[-1]),
          initializer=self.initializer, trainable=True)

    def call(self, inputs):
      length = keras.ops.shape(inputs)[1]
      table = keras.ops.cast(self.embeddings[:length], inputs.dtype)
      return inputs + table

    def compute_output_shape(self, input_shape):
      return input_shape

    def get_config(self):
      config = super().get_config()
      config.update(max_length=self.max_length,
                    initializer=keras.initializers.serialize(self.initializer))
      return config

  return PositionEmbedding


def _inputs(input_shape: Any) -> tuple[Any, Any, Any, int]:
  """`(model inputs, tokens, padding mask or None, T)` for `input_shape`."""
  if isinstance(input_shape, Mapping):
    keys = set(input_shape)
    if keys != {"tokens", "padding_mask"}:
      raise ValueError(f"input_shape keys {sorted(keys)} must be tokens and "
                       "padding_mask (or give one shape (T,) for tokens "
                       "alone).")
    token_shape = tuple(input_shape["tokens"])
    if tuple(input_shape["padding_mask"]) != token_shape:
      raise ValueError(
          f"input_shape padding_mask={tuple(input_shape['padding_mask'])} "
          f"must equal tokens={token_shape}.")
  else:
    token_shape = tuple(input_shape)
  if len(token_shape) != 1 or not token_shape[0] or token_shape[0] < 1:
    raise ValueError(f"input_shape={token_shape} must be (T,): one sequence "
                     "of T token ids per example. Train gpt on a token "
                     "dataset (leave --dataset out for stdlib_text, or give "
                     "your own loader of (n, T) int arrays).")
  tokens = keras.Input(token_shape, dtype="int32", name="tokens")
  if not isinstance(input_shape, Mapping):
    return tokens, tokens, None, token_shape[0]
  mask = keras.Input(token_shape, dtype="int32", name="padding_mask")
  return ({"tokens": tokens, "padding_mask": mask}, tokens, mask,
          token_shape[0])


@register_model("gpt", "A decoder-only transformer language model (causal "
                "attention; sizes tiny .. gpt2_xl via --model_size; reads "
                "stdlib_text unless --dataset is given).",
                sizes=tuple(SIZES), dataset="stdlib_text",
                dataset_options=text_options, blocks=cuttable_blocks)
def gpt(input_shape: Any, num_classes: int, *, size: str = DEFAULT_SIZE,
        name: str = "gpt", **overrides: Any) -> "keras.Model":
  """A GPT: embeddings, `num_layers` causal transformer blocks, logits.

  Args:
    input_shape: `(T,)` for one int32 input `tokens`, or
      `{"tokens": (T,), "padding_mask": (T,)}` for a second input
      `padding_mask` (1 = real token, 0 = padding) that every block's
      attention reads.
    num_classes: vocabulary size (256 for bytes).
    size: a name in `SIZES`. Defaults to `"tiny"`.
    name: model name. Defaults to `"gpt"`.
    **overrides: `num_layers`, `d_model`, `num_heads`, `mlp_ratio`,
      `dropout` replacing the size's.

  Returns:
    A functional model whose output is float32 logits `(B, T, num_classes)`.

  Raises:
    ValueError: an unknown size or option, or a shape that does not hold.
  """
  shape = resolve_size(size, **overrides)
  if not isinstance(num_classes, int) or num_classes < 1:
    raise ValueError(f"num_classes={num_classes!r} must be a positive int "
                     "(the vocabulary size) for gpt.")
  inputs, tokens, mask, length = _inputs(input_shape)
  L = keras.layers
  x = L.Embedding(num_classes, shape.d_model, name="token_embedding")(tokens)
  x = position_embedding_class()(length, name="position_embedding")(x)
  if shape.dropout:
    x = L.Dropout(shape.dropout, name="embedding_dropout")(x)
  if mask is not None:
    mask = L.Reshape((1, length), name="attention_mask")(mask)
  for i in range(shape.num_layers):
    x = _block(x, mask, shape, f"block{i}")
  x = L.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
  outputs = logits_layer(num_classes)(x)
  return keras.Model(inputs, outputs, name=name)


def _block(x: Any, mask: Any, shape: GPTSize, prefix: str) -> Any:
  """One pre-norm block: x + attention(ln1(x)), then x + mlp(ln2(x))."""
  L = keras.layers
  h = L.LayerNormalization(epsilon=1e-5, name=f"{prefix}_ln1")(x)
  attention = L.MultiHeadAttention(
      shape.num_heads, shape.d_model // shape.num_heads,
      dropout=shape.dropout, name=f"{prefix}_attention")
  h = attention(h, h, attention_mask=mask, use_causal_mask=True)
  if shape.dropout:
    h = L.Dropout(shape.dropout, name=f"{prefix}_drop1")(h)
  x = L.Add(name=f"{prefix}_add1")([x, h])
  h = L.LayerNormalization(epsilon=1e-5, name=f"{prefix}_ln2")(x)
  h = L.Dense(shape.d_model * shape.mlp_ratio, activation="gelu",
              name=f"{prefix}_mlp_up")(h)
  h = L.Dense(shape.d_model, name=f"{prefix}_mlp_down")(h)
  if shape.dropout:
    h = L.Dropout(shape.dropout, name=f"{prefix}_drop2")(h)
  return L.Add(name=f"{prefix}_add2")([x, h])
