"""keras_hub `CausalLM` models through their own cache contract.

A keras_hub causal LM decodes with `call_with_cache(token_ids, cache,
cache_update_index)`, returning `(logits, hidden_states, cache)`; its
cache is one tensor `(B, num_layers, 2, length, kv_heads, head_dim)`
(`kv_heads` is the key/value head count under grouped-query attention).
This adapter gives it the interface of `gpt_cache.GPTCache`: the prompt is
written once (`prefill`), then one token per `step`, at a position given
as a tensor, so a compiled step never retraces.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def is_causal_lm(model: Any) -> bool:
  """Whether `model` follows keras_hub's `CausalLM` cache contract."""
  return (callable(getattr(model, "call_with_cache", None))
          and getattr(model, "backbone", None) is not None)


def causal_lm_in(model: Any) -> Any:
  """The keras_hub `CausalLM` that `model` is, or wraps as one of its
  layers (`tfmgpu.models.hub`'s wrapper of `--model=llama` and the like:
  its extra inputs are not used by generation); `None`: neither."""
  for candidate in [model, *getattr(model, "layers", ())]:
    if is_causal_lm(candidate):
      return candidate
  return None


def cache_sizes(get: Callable[[str], Any]) -> dict[str, int | None]:
  """A keras_hub backbone's sizes a cache needs, read by `get(name)` (an
  attribute of the backbone, or a key of its config): `num_layers`,
  `kv_heads` (the key/value heads under grouped-query attention),
  `head_dim`, `max_positions` (`None`: rotary) and `vocab`."""
  heads = (get("num_query_heads") or get("num_heads")
           or get("num_attention_heads"))  # Falcon, SmolLM3.
  positions = get("max_sequence_length")
  return {"num_layers": int(get("num_layers")),
          "kv_heads": int(get("num_key_value_heads") or heads),
          "head_dim": int(get("head_dim") or get("hidden_dim") // heads),
          "max_positions": int(positions) if positions else None,
          "vocab": int(get("vocabulary_size"))}


class HubCache:
  """Cached decoding of a keras_hub `CausalLM` (GPT-2, Llama, Gemma, ...),
  a `decode.CacheAdapter`.

  Args:
    model: the task model (its preprocessor, if any, is not used: inputs
      are token ids).

  Attributes:
    max_positions: the backbone's `max_sequence_length` (learned position
      embeddings), or `None` (rotary: no fixed limit).
    vocab: the logits' width.
  """

  def __init__(self, model: Any):
    self.model = model
    backbone = model.backbone
    sizes = cache_sizes(lambda name: getattr(backbone, name, None))
    self.num_layers, self.kv_heads = sizes["num_layers"], sizes["kv_heads"]
    self.head_dim, self.vocab = sizes["head_dim"], sizes["vocab"]
    self.max_positions = sizes["max_positions"]
    self.dtype = model.compute_dtype
    # Phi3's "su" rotary takes long or short factors by the length called
    # with: keys of a prompt prefilled alone differed from keras_hub's.
    self.prefills_whole_buffer = (
        getattr(backbone, "rope_scaling_type", None) == "su")

  def empty_cache(self, batch: int, length: int) -> tuple[tf.Tensor]:
    """The zero cache of `length` positions, as a 1-tuple."""
    return (tf.zeros((batch, self.num_layers, 2, length, self.kv_heads,
                      self.head_dim), self.dtype),)

  def prefill(self, token_ids: tf.Tensor, cache: tuple[tf.Tensor]
              ) -> tuple[tf.Tensor]:
    """The cache with the keys/values of positions `[0, T)` written."""
    # A tensor index: SmolLM3's blocks refuse a Python 0 next to tensors.
    _, _, written = self.model.call_with_cache(token_ids, cache[0],
                                               tf.constant(0, tf.int32))
    return (written,)

  def step(self, token: tf.Tensor, cache: tuple[tf.Tensor], index: tf.Tensor
           ) -> tuple[tf.Tensor, tuple[tf.Tensor]]:
    """`(logits (B, vocab), cache)` of one token per row at `index`."""
    logits, _, written = self.model.call_with_cache(
        token[:, None], cache[0], index)
    return logits[:, 0, :], (written,)
