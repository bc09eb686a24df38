"""A generation signature for a SavedModel: prefill + decode loop in TF.

`generation_function(model)` is a `tf.function` of plain TF ops that
continues prompts greedily (or with a seeded sampler fixed at export),
taking keras_hub's input form and a scalar `max_new_tokens`; any batch
and prompt width. `tfmgpu.inference.export_saved_model` adds it to a
causal LM's SavedModel as the signature `generate`, so plain TF (or TF
Serving) generates without tfmgpu:

    loaded = tf.saved_model.load(path)
    out = loaded.signatures["generate"](
        token_ids=ids, padding_mask=mask, max_new_tokens=tf.constant(32))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import tensorflow as tf

from tfmgpu.generation import api
from tfmgpu.generation import decode
from tfmgpu.generation import hub_cache
from tfmgpu.generation import samplers

SIGNATURE = "generate"


def input_signature() -> list[tf.TensorSpec]:
  """The signature's inputs: `token_ids (B, T) int32`, `padding_mask
  (B, T) bool` (right-padded prompts) and `max_new_tokens ()` int32."""
  return [tf.TensorSpec((None, None), tf.int32, name="token_ids"),
          tf.TensorSpec((None, None), tf.bool, name="padding_mask"),
          tf.TensorSpec((), tf.int32, name="max_new_tokens")]


def _state(token_ids, padding_mask, max_new_tokens):
  """`(state, first, width)`: `decode.initial_state` in TF ops."""
  mask = tf.cast(padding_mask, tf.bool)
  lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
  longest = tf.reduce_max(lengths)
  width = longest + max_new_tokens
  ids = tf.where(mask, token_ids, 0)[:, :longest]
  tokens = tf.pad(ids, [[0, 0], [0, max_new_tokens]])
  prompt = tf.range(width)[None, :] < lengths[:, None]
  batch = tf.shape(tokens)[0]
  state = {"tokens": tokens, "prompt": prompt, "filled": prompt,
           "done": tf.zeros([batch], tf.bool), "rows": tf.range(batch),
           "ends": lengths + max_new_tokens}
  return state, tf.reduce_min(lengths), width, longest


def _prompt_checks(token_ids, padding_mask, vocab: int) -> list[tf.Operation]:
  """What `tfmgpu.generate` refuses, refused in the graph: a row without
  a prompt token, padding before a prompt's end (a left-padded row would
  continue from its padding: silently wrong tokens), ids outside the
  vocabulary."""
  mask = tf.cast(padding_mask, tf.bool)
  lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
  right_padded = tf.range(tf.shape(mask)[1])[None, :] < lengths[:, None]
  ids = tf.boolean_mask(token_ids, mask)
  return [
      tf.debugging.assert_positive(
          lengths, message="each row needs at least one prompt token "
          "(padding_mask True)"),
      tf.debugging.assert_equal(
          mask, right_padded, message="padding_mask must be True for each "
          "row's prompt, then False: prompts are right-padded (a left-padded "
          "row would continue from its padding)"),
      tf.debugging.assert_non_negative(
          ids, message="token_ids must be >= 0 where padding_mask is True"),
      tf.debugging.assert_less(
          ids, vocab, message=f"token_ids must be < the model's vocabulary "
          f"of {vocab} where padding_mask is True")]


def generation_function(adapter: decode.CacheAdapter, *,
                        sampling: samplers.Sampling = samplers.Sampling(),
                        stop_token_ids: Sequence[int] | None = None
                        ) -> Callable[..., dict[str, tf.Tensor]]:
  """The signature's function for a model's cache adapter (unplaced).

  Args:
    adapter: `tfmgpu.generation.adapter_for(model)`.
    sampling: the sampler (its seed fixed at export; `None`: 0). Defaults
      to greedy.
    stop_token_ids: a row ends after any of these tokens.

  Returns:
    A `tf.function` with `input_signature()`, returning `{"token_ids":
    (B, W) int32, "padding_mask": (B, W) bool}` as `tfmgpu.generate`
    does, `W` the longest prompt plus `max_new_tokens`.
  """
  stops = tuple(int(t) for t in stop_token_ids or ())
  advance = decode.loop_function(
      decode.step_function(adapter, sampling, stops), bool(stops))
  seed = tf.constant(sampling.seed or 0, tf.int32)
  limit = adapter.max_positions

  @tf.function(input_signature=input_signature())
  def generate(token_ids, padding_mask, max_new_tokens):
    checks = [tf.debugging.assert_positive(
        max_new_tokens, message="max_new_tokens must be >= 1"),
              *_prompt_checks(token_ids, padding_mask, adapter.vocab)]
    with tf.control_dependencies(checks):  # Before anything reads them.
      token_ids, padding_mask, max_new_tokens = (
          tf.identity(token_ids), tf.identity(padding_mask),
          tf.identity(max_new_tokens))
    state, first, width, longest = _state(token_ids, padding_mask,
                                          max_new_tokens)
    if limit is not None:
      checks.append(tf.debugging.assert_less_equal(
          width, limit, message=f"the longest prompt + max_new_tokens is "
          f"more than the model's {limit} positions"))
    with tf.control_dependencies(checks):
      state = decode.prefill_function(adapter, longest)(state)
    state = advance(state, first, width, seed)
    filled = state["filled"]
    return {"token_ids": tf.where(filled, state["tokens"], 0),
            "padding_mask": filled}

  return generate


def keeps_its_class(model: Any) -> bool:
  """Whether an exported copy of `model` must be built by its own class
  (a keras_hub `CausalLM`: its cache contract is a method of the class)."""
  return hub_cache.is_causal_lm(model)


def signature_for(model: Any) -> Callable[..., Any] | None:
  """The greedy generation function of an unplaced causal LM (`gpt` or a
  keras_hub `CausalLM`), `None` for any other model."""
  try:
    adapter = api.adapter_for(model)
  except ValueError:
    return None
  return generation_function(adapter)
