"""keras_hub language models by name: `gpt2`, `llama`, `gemma`, `qwen`, `bert`.

The causal LMs (`gpt2`, `llama`, `gemma`, `qwen`) each build a keras_hub
`CausalLM` (its backbone from a config, random
weights; or a local preset directory, `preset=DIR`: nothing is downloaded)
and wraps it so that it reads what tfmgpu's text data gives: `(T,)` token
ids (every position real), or `{"token_ids": (T,), "padding_mask": (T,)}`.
Its logits are `(B, T, vocabulary)`. The wrapper, the task and its backbone
are functional models, so plans cut them between transformer blocks
(`tfmgpu.parallel.graph`), and the backbone's own layout map splits their
weights over tensor-parallel devices (`tfmgpu.parallel.layout_maps`).

Sizes: `tiny` (tests; the vocabulary is the data's `num_classes`) and the
published shapes (`gpt2_base`, `llama3_8b`, `gemma_2b`, `qwen2_5_0_5b`,
...; their own vocabularies) for `--plan_only`.

`bert` builds a keras_hub `BertTextClassifier` (a `BertBackbone` from a
config, random weights; `tiny`, `bert_base`, `bert_large`) that reads `(T,)`
byte ids (segment 0, every position real, or a `padding_mask` given) and
gives `(B, num_classes)` logits. It trains on `stdlib_modules`: which
standard-library module a window of source comes from, a text
classification task on text that ships with Python (a masked LM would need
masking done in the data, and `stdlib_text`'s next-byte targets would let a
bidirectional encoder see the answer). Its vocabulary is the 256 byte
values at `tiny` and BERT's 30522 word pieces at the published sizes (the
bytes are ids below it).

keras-hub is an optional extra (`pip install tfmgpu[hub]`): importing this
module imports neither it, TensorFlow nor Keras.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tfmgpu._lazy import LazyModule
from tfmgpu.models.registry import register_model

keras = LazyModule("keras")

TINY = "tiny"

# `{family: (backbone class, task class, {size: backbone config})}`; a
# `None` vocabulary is the data's `num_classes`.
_DECODER = dict(num_layers=2, hidden_dim=32, intermediate_dim=64)
FAMILIES: dict[str, tuple[str, str, dict[str, dict[str, Any]]]] = {
    "gpt2": ("GPT2Backbone", "GPT2CausalLM", {
        TINY: dict(_DECODER, num_heads=2, dropout=0.0),
        "gpt2_base": dict(vocabulary_size=50257, num_layers=12, num_heads=12,
                          hidden_dim=768, intermediate_dim=3072),
        "gpt2_medium": dict(vocabulary_size=50257, num_layers=24,
                            num_heads=16, hidden_dim=1024,
                            intermediate_dim=4096),
        "gpt2_large": dict(vocabulary_size=50257, num_layers=36, num_heads=20,
                           hidden_dim=1280, intermediate_dim=5120),
    }),
    "llama": ("LlamaBackbone", "LlamaCausalLM", {
        TINY: dict(_DECODER, num_query_heads=4, num_key_value_heads=2),
        "llama2_7b": dict(vocabulary_size=32000, num_layers=32,
                          num_query_heads=32, num_key_value_heads=32,
                          hidden_dim=4096, intermediate_dim=11008),
        "llama3_8b": dict(vocabulary_size=128256, num_layers=32,
                          num_query_heads=32, num_key_value_heads=8,
                          hidden_dim=4096, intermediate_dim=14336,
                          rope_max_wavelength=500000),
    }),
    "gemma": ("GemmaBackbone", "GemmaCausalLM", {
        TINY: dict(_DECODER, num_query_heads=4, num_key_value_heads=2,
                   head_dim=8),
        "gemma_2b": dict(vocabulary_size=256000, num_layers=18,
                         num_query_heads=8, num_key_value_heads=1,
                         hidden_dim=2048, intermediate_dim=32768,
                         head_dim=256),
        "gemma_7b": dict(vocabulary_size=256000, num_layers=28,
                         num_query_heads=16, num_key_value_heads=16,
                         hidden_dim=3072, intermediate_dim=49152,
                         head_dim=256),
    }),
    "qwen": ("QwenBackbone", "QwenCausalLM", {
        TINY: dict(_DECODER, num_query_heads=4, num_key_value_heads=2),
        "qwen2_5_0_5b": dict(vocabulary_size=151936, num_layers=24,
                             num_query_heads=14, num_key_value_heads=2,
                             hidden_dim=896, intermediate_dim=4864,
                             tie_word_embeddings=True),
        "qwen2_5_7b": dict(vocabulary_size=152064, num_layers=28,
                           num_query_heads=28, num_key_value_heads=4,
                           hidden_dim=3584, intermediate_dim=18944),
    }),
}

# `{family: (backbone class, task class, {size: backbone config})}` of the
# text classifiers.
ENCODERS: dict[str, tuple[str, str, dict[str, dict[str, Any]]]] = {
    "bert": ("BertBackbone", "BertTextClassifier", {
        TINY: dict(_DECODER, vocabulary_size=256, num_heads=2, dropout=0.0),
        "bert_base": dict(vocabulary_size=30522, num_layers=12, num_heads=12,
                          hidden_dim=768, intermediate_dim=3072),
        "bert_large": dict(vocabulary_size=30522, num_layers=24,
                           num_heads=16, hidden_dim=1024,
                           intermediate_dim=4096),
    }),
}

# The sequence length each size reads from `stdlib_text` (`stdlib_modules`
# for the encoders, whose published context is 512).
CONTEXT_TINY, CONTEXT_PUBLISHED, CONTEXT_ENCODER = 64, 1024, 512


def text_options(size: str | None) -> dict[str, int]:
  """`stdlib_text`'s options for a size: short windows for `tiny`."""
  return {"seq_len": CONTEXT_TINY if size in (None, TINY)
          else CONTEXT_PUBLISHED}


def encoder_options(size: str | None) -> dict[str, int]:
  """`stdlib_modules`' options for an encoder's size."""
  return {"seq_len": CONTEXT_TINY if size in (None, TINY)
          else CONTEXT_ENCODER}


def check_preset(model: str, preset: str) -> None:
  """Checks a `model_preset` setting without importing TensorFlow.

  Raises:
    ValueError: `model` is not a keras_hub model of this registry, or
      `preset` is not a local preset directory (with its `config.json`).
  """
  import os  # pylint: disable=g-import-not-at-top
  if model not in FAMILIES and model not in ENCODERS:
    raise ValueError(
        f"model_preset={preset!r} is given for model={model!r}, which "
        "loads no keras_hub preset; use one of "
        f"{', '.join([*FAMILIES, *ENCODERS])}.")
  if not os.path.isfile(os.path.join(str(preset), "config.json")):
    raise ValueError(
        f"model_preset={preset!r} is not a local keras_hub preset directory "
        "(no config.json in it); nothing is downloaded: save one with "
        "model.save_to_preset(DIR) or copy a downloaded preset there.")


def _keras_hub():
  try:
    import keras_hub  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "the keras_hub models need keras-hub: pip install 'tfmgpu[hub]' "
        f"(or keras-hub). ({e})") from e
  return keras_hub


def causal_lm(family: str, size: str = TINY, *, vocabulary_size: int,
              sequence_length: int, preset: str | None = None) -> Any:
  """A keras_hub `CausalLM` of `family` at `size` (no preprocessor), or the
  one saved in the local preset directory `preset`."""
  hub = _keras_hub()
  backbone_name, task_name, sizes = FAMILIES[family]
  task = getattr(hub.models, task_name)
  # No default compile: tfmgpu compiles (and a plan's shapes-only build
  # may make no optimizer variables).
  if preset is not None:
    return task.from_preset(preset, preprocessor=None, compile=False)
  if size not in sizes:
    raise ValueError(f"model_size={size!r} is not a size of model "
                     f"{family!r}. Choose one of {', '.join(sizes)}.")
  config = dict(sizes[size])
  config.setdefault("vocabulary_size", vocabulary_size)
  if family == "gpt2":
    config["max_sequence_length"] = max(sequence_length, 1024 if size != TINY
                                        else sequence_length)
  backbone = getattr(hub.models, backbone_name)(**config)
  return task(backbone=backbone, preprocessor=None, compile=False)


def _token_shape(input_shape: Any) -> tuple[int, bool]:
  """`(T, has a padding mask input)` of the data's example shape."""
  if isinstance(input_shape, Mapping):
    shape = tuple(input_shape.get("token_ids", input_shape.get("tokens",
                                                               ())))
    masked = "padding_mask" in input_shape
  else:
    shape, masked = tuple(input_shape), False
  if len(shape) != 1 or not shape[0]:
    raise ValueError(
        f"input_shape={input_shape!r} must be (T,) token ids per example "
        "(or a dict with token_ids and padding_mask): train a keras_hub "
        "model on token data (stdlib_text, the default).")
  return int(shape[0]), masked


def _token_inputs(length: int, masked: bool) -> tuple[Any, Any, Any]:
  """`(model inputs, token ids, padding mask)`: the ids alone (the mask all
  ones), or `{"token_ids", "padding_mask"}` when the data has a mask."""
  ids = keras.Input((length,), dtype="int32", name="token_ids")
  if not masked:
    return ids, ids, keras.ops.ones_like(ids)
  mask = keras.Input((length,), dtype="int32", name="padding_mask")
  return {"token_ids": ids, "padding_mask": mask}, ids, mask


def build(family: str, input_shape: Any, num_classes: int, *,
          size: str = TINY, preset: str | None = None) -> "keras.Model":
  """The `CausalLM` wrapped to take tfmgpu's token data; see the module."""
  length, masked = _token_shape(input_shape)
  lm = causal_lm(family, size, vocabulary_size=int(num_classes or 256),
                 sequence_length=length, preset=preset)
  _check_vocabulary(lm, num_classes, preset)
  _check_positions(lm.backbone, length, preset)
  inputs, ids, mask = _token_inputs(length, masked)
  logits = lm({"token_ids": ids, "padding_mask": mask})
  return keras.Model(inputs, logits, name=family)


def _check_vocabulary(lm: Any, num_classes: int, preset: str | None
                      ) -> None:
  """Refuses a preset whose vocabulary is smaller than the data's token
  ids (`num_classes`): its embedding lookup failed deep in TF (GatherV2
  "indices ... not in [0, 64)"); on a GPU TF's gather returns zeros for
  such ids, silently."""
  vocabulary = int(lm.backbone.vocabulary_size)
  if preset is None or not num_classes or num_classes <= vocabulary:
    return
  raise ValueError(
      f"model_preset={preset!r} has vocabulary_size={vocabulary}, but the "
      f"data has num_classes={num_classes} (token ids up to "
      f"{num_classes - 1}): the model cannot read or predict ids from "
      f"{vocabulary} on. Use data tokenized with the preset's own "
      f"vocabulary (ids below {vocabulary}; --dataset=module:function "
      "for your own), or a preset whose vocabulary_size is at least "
      f"{num_classes}.")


def _check_positions(backbone: Any, length: int, preset: str | None) -> None:
  """Refuses a preset with learned positions (GPT-2, BERT:
  `max_sequence_length`) fewer than the data's `length` tokens per
  example: its position embedding failed deep in TF's gradient ("Paddings
  must be non-negative", a new user's trial). Rotary models have no such
  limit."""
  limit = getattr(backbone, "max_sequence_length", None)
  if preset is None or not limit or length <= int(limit):
    return
  raise ValueError(
      f"model_preset={preset!r} has max_sequence_length={limit} positions, "
      f"but the data's examples are {length} tokens long: the model has no "
      f"position for token {limit} on. Use sequences of at most {limit} "
      "tokens (your own --dataset=module:function), or a preset with at "
      f"least {length} positions.")


def text_classifier(family: str, size: str = TINY, *, num_classes: int,
                    sequence_length: int, preset: str | None = None) -> Any:
  """A keras_hub text classifier of `family` at `size` (no preprocessor,
  dropout 0 at `tiny`), or the one saved in the local preset `preset`."""
  hub = _keras_hub()
  backbone_name, task_name, sizes = ENCODERS[family]
  task = getattr(hub.models, task_name)
  if preset is not None:
    return _classifier_preset(task, preset, num_classes)
  if size not in sizes:
    raise ValueError(f"model_size={size!r} is not a size of model "
                     f"{family!r}. Choose one of {', '.join(sizes)}.")
  config = dict(sizes[size])
  config["max_sequence_length"] = (sequence_length if size == TINY
                                   else max(sequence_length, CONTEXT_ENCODER))
  backbone = getattr(hub.models, backbone_name)(**config)
  return task(backbone=backbone, num_classes=num_classes, preprocessor=None,
              dropout=config.get("dropout", 0.1), compile=False)


def _classifier_preset(task: Any, preset: str, num_classes: int) -> Any:
  """The classifier saved in `preset` with its head (checked against
  `num_classes`), or a backbone-only preset with a new random head."""
  import os  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(os.path.join(str(preset), "task.json")):
    return task.from_preset(preset, num_classes=num_classes,
                            preprocessor=None, compile=False)
  # keras_hub skips the saved head whenever num_classes is passed.
  model = task.from_preset(preset, preprocessor=None, compile=False)
  if model.num_classes != num_classes:
    raise ValueError(
        f"model_preset={preset!r} holds a classifier of {model.num_classes} "
        f"classes but the data has num_classes={num_classes}: use a preset "
        "with only the backbone (its head is then new), or data with "
        f"{model.num_classes} classes.")
  return model


def build_classifier(family: str, input_shape: Any, num_classes: int, *,
                     size: str = TINY, preset: str | None = None
                     ) -> "keras.Model":
  """The text classifier wrapped to take tfmgpu's token data: `(T,)` ids
  (or `{"token_ids", "padding_mask"}`), segment 0; `(B, num_classes)`."""
  length, masked = _token_shape(input_shape)
  if not num_classes:
    raise ValueError(
        f"num_classes={num_classes!r}: model {family!r} classifies texts "
        "and needs class labels (stdlib_modules, the default, has 12).")
  task = text_classifier(family, size, num_classes=int(num_classes),
                         sequence_length=length, preset=preset)
  _check_positions(task.backbone, length, preset)
  inputs, ids, mask = _token_inputs(length, masked)
  logits = task({"token_ids": ids, "segment_ids": keras.ops.zeros_like(ids),
                 "padding_mask": mask})
  return keras.Model(inputs, logits, name=family)


def _register(family: str, title: str) -> None:
  encoder = family in ENCODERS
  sizes = tuple((ENCODERS if encoder else FAMILIES)[family][2])
  make = build_classifier if encoder else build

  def builder(input_shape: Any, num_classes: int, *, size: str = TINY,
              preset: str | None = None) -> "keras.Model":
    return make(family, input_shape, num_classes, size=size, preset=preset)

  task = "text classifier" if encoder else "causal LM"
  dataset = "stdlib_modules" if encoder else "stdlib_text"
  builder.__name__ = family
  builder.__doc__ = f"keras_hub's {title} {task} (see `models.hub`)."
  register_model(
      family, f"keras_hub {title} {task} (random weights; sizes "
      f"{sizes[0]} .. {sizes[-1]}; --model_preset=DIR loads a local preset; "
      f"reads {dataset} unless --dataset is given).", sizes=sizes,
      dataset=dataset,
      dataset_options=encoder_options if encoder else text_options)(builder)


for _family, _title in (("gpt2", "GPT-2"), ("llama", "Llama"),
                        ("gemma", "Gemma"), ("qwen", "Qwen"),
                        ("bert", "BERT")):
  _register(_family, _title)
