"""What a layer's config leaves out and a copy of it must keep: which of
its layers and weights are frozen, which layers carry LoRA, and lookup
layers' adapted vocabularies.

Splits rebuild layers from configs (`cloning`). A config rebuilds a layer
as constructed, not as the user left it: a keras_hub block frozen with
`block.trainable = False`, or a backbone after `enable_lora(rank)`, comes
back from its backbone's config trainable and without LoRA. A split would
then train weights the user froze, silently, or fail to copy the LoRA
weights. In Keras 3 freezing lives on each variable (`Layer.trainable`
sets its variables' flags), so the state is the layers' `trainable` flags,
their LoRA ranks and every weight's `trainable` flag, in walk order. A
`TextVectorization` / `StringLookup` copied from its config has an empty
table ("Table not initialized"): its vocabulary is set again. A keras_hub
task's preprocessor runs on the data, not in the model's call: a copy
takes the original's as it is, and its layers are no state to compare
(a split takes preprocessed inputs).

* `capture(layer)` records it; `apply(state, copy)` sets it on a built copy
  of the same structure; `mirror(layer, copy)` does both.
* `set_weights(target, weights)`: every copy of weights goes through it.
  An adapted `Normalization` divides by constants it computes from its
  weights in `finalize_state()`, which Keras' load calls and `set_weights`
  does not: a copy kept the zero mean and unit variance it was built with
  (predictions 6.8 off the model's), so `set_weights` finalizes them.
* `weighted_layers(model)`: the layers whose weights a checkpoint of any
  layout keys by name (nested functional models looked into).
* `variable(layer, name)`: a layer's kernel variable, LoRA or not.
* `refuse_split(layer, path)`: tensor parallelism makes new variables for
  a layer's shards, so it splits only a layer whose weights are all
  trainable or all frozen, without LoRA; the others are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras

from tfmgpu import _compat


@dataclasses.dataclass(frozen=True)
class LayerRecord:
  """One (nested) layer: its class name, `trainable` flag, LoRA, and a
  lookup layer's vocabulary (`TextVectorization`, `StringLookup`, ...:
  adapted state Keras saves as an asset, not in the config)."""
  kind: str
  trainable: bool
  lora_rank: int | None = None
  lora_alpha: float | None = None
  vocabulary: tuple[Any, ...] | None = None
  output_mode: str | None = None


@dataclasses.dataclass(frozen=True)
class LayerState:
  """A layer's and its nested layers' records (depth first, the layer
  first), its weights' `trainable` flags and their paths (in
  `layer.weights` order), and a keras_hub task's preprocessor, kept as it
  is (rebuilt from its config, its tokenizer has no vocabulary: keras_hub
  saves it as an asset)."""
  layers: tuple[LayerRecord, ...]
  variables: tuple[bool, ...]
  paths: tuple[str, ...] = ()
  preprocessor: Any = None


def _record(layer: keras.layers.Layer) -> LayerRecord:
  lora = getattr(layer, "lora_enabled", False)
  vocabulary = None
  if hasattr(layer, "get_vocabulary") and hasattr(layer, "set_vocabulary"):
    vocabulary = tuple(t.item() if hasattr(t, "item") else t
                       for t in layer.get_vocabulary())
  return LayerRecord(type(layer).__name__, bool(layer.trainable),
                     getattr(layer, "lora_rank", None) if lora else None,
                     getattr(layer, "lora_alpha", None) if lora else None,
                     vocabulary, getattr(layer, "output_mode", None))


def weighted_layers(model: keras.Model) -> dict[str, Any]:
  """`{layer name: layer}` of `model`'s layers with weights, the layers of
  nested functional models (a keras_hub backbone) by their own names, as
  placed models list them (`tfmgpu.parallel.graph` cuts inside them): the
  names a checkpoint of any layout keys each layer's weights by."""
  found: dict[str, Any] = {}
  level = list(model.layers)
  while level:
    for layer in level:
      if layer.weights and not _compat.is_functional(layer):
        found.setdefault(layer.name, layer)
    level = [l for m in level if _compat.is_functional(m) for l in m.layers]
  return found


def capture(layer: keras.layers.Layer) -> LayerState:
  """`layer`'s frozen flags, LoRA and vocabularies, to set on a copy
  (`apply`); a keras_hub task's preprocessor left out (`_state_layers`)."""
  preprocessor = getattr(layer, "preprocessor", None)
  return LayerState(
      tuple(_record(l) for l in _state_layers(layer)),
      tuple(bool(v.trainable) for v in layer.weights),
      tuple(v.path for v in layer.weights),
      preprocessor if is_preprocessor(preprocessor) else None)


def _state_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
  """`layer` and its nested layers, depth first, except a keras_hub task's
  preprocessor and its layers (tokenizer, packer), even one detached with
  `task.preprocessor = None`, which Keras still tracks: it runs on the
  data, outside the forward pass a copy or split makes (which takes
  preprocessed inputs); built on its first use, it differed from its
  copy's and made every split of the task fail."""
  skipped: set[int] = set()
  kept = []
  for l in _compat.flatten_layers(layer):  # Parents before their layers.
    if id(l) in skipped:
      continue
    if is_preprocessor(l):
      skipped.update(id(s) for s in _compat.flatten_layers(l))
    else:
      kept.append(l)
  return kept


def is_preprocessor(layer: Any) -> bool:
  """Whether `layer` is a keras_hub `Preprocessor` (a task's
  tokenizer-and-packer), which the model's own call never runs."""
  return any(c.__name__ == "Preprocessor" and c.__module__.startswith(
      "keras_hub") for c in type(layer).__mro__)


def apply(state: LayerState, copy: keras.layers.Layer) -> None:
  """Sets `state` (captured from the original) on `copy`, a built copy of
  it: its preprocessor, each layer's `trainable`, LoRA where the original
  had it (ranks and alphas), then each weight's `trainable`.

  Raises:
    ValueError: `copy` differs in structure from the original while the
      two differ in state, so tfmgpu cannot tell which of its weights to
      freeze; named.
  """
  if state.preprocessor is not None and hasattr(copy, "preprocessor"):
    copy.preprocessor = state.preprocessor  # The same, not a copy.
  special = any(r.lora_rank or r.vocabulary for r in state.layers)
  if not special and tuple(bool(v.trainable) for v in copy.weights) == (
      state.variables):
    return  # Each weight's flag is what trains it (`trainable_weights`).
  layers = _state_layers(copy)
  if [type(l).__name__ for l in layers] == [r.kind for r in state.layers]:
    for record, layer in zip(state.layers, layers):  # Parents first.
      if layer.trainable != record.trainable:
        layer.trainable = record.trainable
    for record, layer in zip(state.layers, layers):
      if record.lora_rank and not getattr(layer, "lora_enabled", False):
        layer.enable_lora(record.lora_rank, lora_alpha=record.lora_alpha)
      if record.vocabulary:
        _set_vocabulary(layer, record)
  elif special:  # A layer shared with a nested model may be listed twice.
    raise _mismatch(copy, "its nested layers")
  weights = copy.weights
  if len(weights) != len(state.variables):
    raise _mismatch(copy, f"its weights ({len(weights)} against "
                    f"{len(state.variables)})")
  for variable, trainable in zip(weights, state.variables):
    if variable.trainable != trainable:
      variable.trainable = trainable


def _set_vocabulary(layer: keras.layers.Layer, record: LayerRecord) -> None:
  """A lookup layer's adapted vocabulary, which its config leaves out (the
  copy's table was empty: "Table not initialized" at its first call)."""
  if record.output_mode == "tf_idf":
    raise ValueError(
        f"layer {layer.name!r} ({record.kind}, output_mode='tf_idf') holds "
        "IDF weights tfmgpu cannot copy with its vocabulary, and this "
        "placement copies the model's layers. Apply it in the tf.data "
        "pipeline (dataset.map(layer)) and give the model its output, or "
        "serve the model unsplit.")
  layer.set_vocabulary(list(record.vocabulary))


def mirror(layer: keras.layers.Layer, copy: keras.layers.Layer) -> None:
  """`apply(capture(layer), copy)`: `copy` frozen and LoRA'd as `layer`."""
  apply(capture(layer), copy)


def set_weights(target: Any, weights: Sequence[Any]) -> None:
  """`target.set_weights(weights)`, then the adapted statistics its layers
  compute from their weights recomputed (`finalize`), as Keras' own load
  does. Every copy of weights between a model and its copies or splits
  goes through here."""
  target.set_weights(weights)
  finalize(target)


def finalize(target: Any) -> None:
  """Calls `finalize_state()` on each adapted `Normalization` in `target`
  (a layer or model; anything else is left alone): its mean and variance
  are constants computed from its `adapt_mean` / `adapt_variance` weights,
  stale after `set_weights`. Keras' other layers with `finalize_state`
  are not called: a `Discretization` recomputes its bin boundaries from
  the data `adapt` saw, which a copy never saw (its boundaries, from its
  config, would be emptied), and a lookup layer's vocabulary is set by
  `apply`."""
  if not isinstance(target, keras.layers.Layer):
    return
  for layer in _compat.flatten_layers(target):
    if isinstance(layer, keras.layers.Normalization) and layer.built:
      layer.finalize_state()


def _mismatch(copy: keras.layers.Layer, what: str) -> ValueError:
  return ValueError(
      f"layer {copy.name!r} ({type(copy).__name__}) holds state its config "
      "leaves out (frozen weights, LoRA, a lookup vocabulary, or a "
      "constructor argument its get_config drops: keras_hub 0.32's "
      "LlamaBackbone drops tie_word_embeddings), and its copy rebuilt "
      f"from that config differs in {what}, so tfmgpu cannot "
      "carry the state over exactly. Train it with data parallelism "
      "(mirrored, ZeRO), which keeps the model as it is.")


def refuse_split(layer: keras.layers.Layer, path: str) -> None:
  """Raises unless tensor parallelism can split `layer` (whose weight
  `path` a rule or layout names) exactly: no LoRA, and its weights all
  trainable or all frozen (its shards take the layer's `trainable`).

  Raises:
    ValueError: naming the layer, the weight and what to do.
  """
  why = why_unsplittable(layer)
  if why:
    raise ValueError(
        f"the tensor-parallel split names weight {path!r} of layer "
        f"{layer.name!r} ({type(layer).__name__}), but tfmgpu cannot split "
        f"it: {why}. Leave it whole (drop it from the rules or layout map), "
        "or split the model into stages (model_parallel, pipeline) or train "
        "it with data parallelism, which keep such layers as they are.")


def why_unsplittable(layer: keras.layers.Layer) -> str | None:
  """Why tensor parallelism cannot split `layer` exactly (LoRA, or only
  some of its weights frozen), else `None`."""
  if getattr(layer, "lora_enabled", False):
    return (f"it has LoRA enabled (rank {getattr(layer, 'lora_rank', '?')}), "
            "whose low-rank factors tfmgpu does not shard")
  if len({bool(v.trainable) for v in layer.weights}) > 1:
    frozen = [v.path for v in layer.weights if not v.trainable]
    return f"only some of its weights are frozen ({', '.join(frozen)})"
  return None


def trainable_of(layer: keras.layers.Layer) -> bool:
  """The `trainable` flag a split copy of `layer` takes: `False` when its
  weights are frozen (by it or by a frozen parent), else its own."""
  weights = layer.weights
  if weights and not any(v.trainable for v in weights):
    return False
  return bool(layer.trainable)


def variable(layer: keras.layers.Layer, name: str) -> Any:
  """`layer`'s own variable `name` (`kernel`, `embeddings`). With LoRA
  enabled, Keras' `layer.kernel` is the merged tensor, not the variable."""
  for v in layer.weights:
    if v.path.rsplit("/", 1)[-1] == name:
      return v
  return getattr(layer, name, None)
