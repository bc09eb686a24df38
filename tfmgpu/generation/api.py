"""`generate`: text from a causal language model, with a KV cache.

Takes tfmgpu's `gpt` or a keras_hub `CausalLM` (or a model wrapping one),
unplaced, on one device or with its request rows spread over a
`tf.distribute.Strategy`'s replicas; or either placed by
`tfmgpu.parallel.hybrid.build_layout` (tensor, pipeline, data and their
hybrids), each cache beside its layer.
"""

from __future__ import annotations

import os
import secrets
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from absl import logging
import numpy as np
import tensorflow as tf

from tfmgpu import strategies as strategies_lib
from tfmgpu.generation import decode
from tfmgpu.generation import gpt_cache
from tfmgpu.generation import hub_cache
from tfmgpu.generation import placed as placed_lib
from tfmgpu.generation import prompts as prompts_lib
from tfmgpu.generation import samplers
from tfmgpu.parallel import cloning
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import placed_model
from tfmgpu.parallel import zero


def adapter_for(model: Any) -> decode.CacheAdapter:
  """The cache adapter of `model`: `GPTCache`, `HubCache`, or for a placed
  model its copies' and stages' caches (`placed.placed_adapter`); a ZeRO
  `ShardedModel` decodes with the model it shards, whose weights its
  owners hold (a trial's sharded Gemma was refused as no causal LM).

  Raises:
    ValueError: a model that is neither a `gpt` nor a keras_hub `CausalLM`
      (nor wraps one), placed or not.
  """
  if isinstance(model, zero.ShardedModel):  # Its weights on their owners,
    return adapter_for(model.unsplit)  # read across devices as it decodes.
  if placed_model.is_placed(model):
    return placed_lib.placed_adapter(model)
  lm = hub_cache.causal_lm_in(model)
  if lm is not None:
    return hub_cache.HubCache(lm)
  if gpt_cache.is_gpt(model):
    return gpt_cache.GPTCache(model)
  raise ValueError(
      f"model {getattr(model, 'name', model)!r} ({type(model).__name__}) is "
      "neither tfmgpu's gpt nor a keras_hub CausalLM: generate takes one of "
      "those (build one with tfmgpu.build_model('gpt', ...))."
      + (" An encoder-decoder (a keras_hub Seq2SeqLM: BART, T5) generates "
         "with its own model.generate(...)." if "Seq2Seq" in
         type(model).__name__ else ""))


def _copy_in_scope(model: Any, strategy: tf.distribute.Strategy) -> Any:
  """A copy of `model` made in `strategy`'s scope, so each replica decodes
  with its own copy of the weights on its own device."""
  logging.info(
      "generate: model %r's weights were made outside the strategy's scope; "
      "each of its %d replicas decodes with a copy made in it (build or "
      "load the model under `with strategy.scope():` to skip the copy).",
      getattr(model, "name", ""), strategy.num_replicas_in_sync)
  return cloning.copy_model(model, strategy,
                            same_class=hub_cache.is_causal_lm(model))


def _device_of(strategy: tf.distribute.Strategy) -> str | None:
  """The device of a one-replica strategy; `None` for TF's default
  strategy, which has none (TF places ops)."""
  try:
    return strategy.extended.worker_devices[0]
  except RuntimeError:  # "unsupported by default tf.distribute.Strategy".
    return None


class Generator:
  """Compiled generation for one model and device setup.

  Holds the model's cache adapter and its compiled decode loops (one per
  sampler and stop tokens), so repeated requests of the same shape do not
  retrace.

  Args:
    model: tfmgpu's `gpt` or a keras_hub `CausalLM`, unplaced; or either
      placed by `hybrid.build_layout` (it places its own work: no
      strategy, no XLA).
    strategy: `None` (one device), a registered name (e.g. `"mirrored"`)
      or a `tf.distribute.Strategy`: the request rows are split over its
      replicas, each decoding its rows on its own device with its own
      copy of the weights. A model built (or loaded) outside the
      strategy's scope is copied into it when the generator is made
      (`model` stays as it was; `refresh()` copies its weights again).
    jit_compile: compile each replica's decode loop with XLA. Defaults to
      `True` (always `False` for a placed model: XLA compiles for one
      device).

  Raises:
    ValueError: a strategy given with a placed model, or an unsupported
      model (see `adapter_for`).

  Attributes:
    model: the model it decodes with (the copy, when it made one).
    adapter: that model's cache adapter (`adapter_for`).
    traces: how many times a decode loop was traced (one per request shape
      and sampler, not per token; streamed or not).
    graphs: the graph of each of those traces.
  """

  def __init__(self, model: Any, *, strategy: Any = None,
               jit_compile: bool = True):
    adapter = adapter_for(model)  # Checks the model first.
    if placed_model.is_placed(model):
      if strategy is not None:
        raise ValueError(
            f"strategy={strategy!r} was given with model {model.name!r}, "
            "which is placed over devices already (its data-parallel copies "
            "take the rows). Leave strategy=None.")
      jit_compile = False
    if isinstance(strategy, str):
      strategy = strategies_lib.get_strategy(strategy)
    device = None
    if strategy is not None and strategy.num_replicas_in_sync == 1:
      device = _device_of(strategy)  # E.g. one_device's.
      strategy = None  # One replica: run the loop directly, there.
    self._source = None  # The model copied, when one was.
    if strategy is not None and not cloning.built_in_scope(model, strategy):
      self._source = model
      model = _copy_in_scope(model, strategy)
      adapter = adapter_for(model)
    self.model = model
    self.adapter = adapter
    self._runner = decode.Runner(strategy, jit_compile, device=device)

  def refresh(self) -> None:
    """Copies the given model's current weights into the copy this
    generator made in the strategy's scope (no retrace); nothing when it
    made none. `tfmgpu.generate` does it before every request, so a model
    trained on since still generates with its latest weights."""
    if self._source is not None:
      layer_state.set_weights(self.model, self._source.get_weights())

  @property
  def traces(self) -> int:
    return self._runner.traces

  @property
  def graphs(self) -> list[tf.Graph]:
    """The graph of each decode-loop trace (to read where its ops run)."""
    return self._runner.graphs

  def stream(self, inputs: Any, *, max_new_tokens: int,
             sampling: samplers.Sampling = samplers.Sampling(),
             stop_token_ids: Sequence[int] | None = None
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields `(tokens (B,), written (B,) bool)` after each position (one
    compiled call each): the token each row got there, and whether it is
    new (not its prompt's). The first is the last position of the shortest
    prompt (nothing new), read before any decoding.

    Args and Raises: as `generate`.
    """
    for state, index, rows in self._run(inputs, max_new_tokens, sampling,
                                        stop_token_ids, each=True):
      local = self._runner.local
      tokens = local(state["tokens"])[:rows, index]
      written = local(state["filled"])[:rows, index]
      yield tokens, written & ~local(state["prompt"])[:rows, index]

  def generate(self, inputs: Any, *, max_new_tokens: int,
               sampling: samplers.Sampling = samplers.Sampling(),
               stop_token_ids: Sequence[int] | None = None
               ) -> dict[str, np.ndarray]:
    """See `tfmgpu.generate` (the module function)."""
    state, rows = None, 0
    for state, _, rows in self._run(inputs, max_new_tokens, sampling,
                                    stop_token_ids, each=False):
      pass
    return {"token_ids": self._runner.local(state["tokens"])[:rows],
            "padding_mask": self._runner.local(state["filled"])[:rows]}

  def _run(self, inputs, max_new_tokens, sampling, stop_token_ids, each):
    """Yields `(state, index, rows)` after prefill, then after each position
    (`each`) or once at the end."""
    request = prompts_lib.read(inputs, max_new_tokens,
                               self.adapter.max_positions,
                               self._runner.replicas,
                               vocab=getattr(self.adapter, "vocab", None))
    seed = sampling.seed
    if seed is None:
      seed = 0 if sampling.sampler == "greedy" else secrets.randbelow(2**30)
    if stop_token_ids is not None and not isinstance(
        stop_token_ids, (list, tuple, set, np.ndarray)):
      raise ValueError(f"stop_token_ids={stop_token_ids!r} must be a list "
                       f"of token ids, e.g. [{stop_token_ids!r}].")
    stops = tuple(int(t) for t in stop_token_ids or ())
    state = decode.initial_state(request.token_ids, request.lengths,
                                 np.arange(len(request.lengths)),
                                 request.width, max_new_tokens)
    runner = self._runner
    width = request.token_ids.shape[1]
    state = runner.prefill(width, lambda: decode.prefill_function(
        self.adapter, width), runner.place(state))
    yield state, request.first - 1, request.rows
    key = (sampling.sampler, sampling.k, sampling.p, sampling.temperature,
           stops)
    advance = runner.compiled_loop(key, lambda: decode.loop_function(
        decode.step_function(self.adapter, sampling, stops), bool(stops)))
    for index, state in decode.positions(
        runner, advance, state, request.first, request.width, seed,
        each=each, stop_early=bool(stops)):
      yield state, index, request.rows


_GENERATORS: "weakref.WeakKeyDictionary[Any, dict]" = (
    weakref.WeakKeyDictionary())


def _refuse_a_path(model: Any) -> None:
  """A path is loaded by `tfmgpu.generate` (the CLI module's call), which
  may import `tfmgpu.inference`; this module may not (a circle)."""
  if isinstance(model, (str, os.PathLike)):
    raise ValueError(
        f"model={os.fspath(model)!r} is a path: tfmgpu.generate(path, ...) "
        "loads it for one call; here, load it first (tfmgpu.inference."
        "load_model(path)) and pass the model.")


def generate(model: Any, inputs: Any, *, max_new_tokens: int,
             sampler: str = "greedy", k: int | None = None,
             p: float | None = None, temperature: float = 1.0,
             seed: int | None = None,
             stop_token_ids: Sequence[int] | None = None,
             strategy: Any = None) -> dict[str, np.ndarray]:
  """Continues each prompt by up to `max_new_tokens` tokens, with a KV cache.

  The prompts are read once (prefill), then one compiled decode step per
  position fills every row (it traces once per request shape). The
  compiled steps are kept per model and strategy (see `Generator`).

  Args:
    model: tfmgpu's `gpt` or a keras_hub `CausalLM` (its preprocessor is not
      used; or a model wrapping one), unplaced; or either placed by
      `hybrid.build_layout`: each layer's cache and work stay on its
      devices, rows split over its data-parallel copies (and over a
      pipeline's stages). `tfmgpu.generate` also takes the path of its
      `.keras` file (or a run's `--model_dir`), loaded for that call (load
      it once yourself, `tfmgpu.inference.load_model`, to generate many
      times).
    inputs: keras_hub's form `{"token_ids": (B, T) int, "padding_mask":
      (B, T) bool}` (prompts of different lengths, right-padded), or a
      `(B, T)` token array whose tokens are all prompt (`(T,)`: one row).
    max_new_tokens: new tokens per row at most (>= 1).
    sampler: `"greedy"`, `"top_k"`, `"top_p"` or `"random"`.
    k: the `k` of `top_k`.
    p: the `p` of `top_p`.
    temperature: divides the logits before sampling (not greedy).
    seed: an int: the same seed gives the same tokens, however the rows
      are split over replicas (a row draws by its index in the call: at
      another index it samples others). Defaults to a fresh one per call.
    stop_token_ids: a row ends after any of these tokens (kept in its
      output). Defaults to none: every row gets `max_new_tokens`.
    strategy: `None` (one device), a registered name such as
      `"mirrored"`, or a `tf.distribute.Strategy`: rows are split over its
      replicas.

  Returns:
    keras_hub's output form: `{"token_ids": (B, W) int32, "padding_mask":
    (B, W) bool}`, `W` the longest prompt plus `max_new_tokens`: each row's
    prompt, then its new tokens, then zeros where `padding_mask` is False.

  Raises:
    ValueError: an unsupported model (see `adapter_for`) or a path,
      inputs that are not right-padded prompts, a sequence longer than the
      model's positions, or bad sampler options.
  """
  _refuse_a_path(model)
  sampling = samplers.Sampling(sampler, k=k, p=p, temperature=temperature,
                               seed=seed)
  key = strategy if isinstance(strategy, str) or strategy is None else id(
      strategy)
  cache = _GENERATORS.setdefault(model, {})
  if key not in cache:
    cache[key] = Generator(model, strategy=strategy)
  else:
    cache[key].refresh()  # A copy in the strategy's scope: latest weights.
  return cache[key].generate(inputs, max_new_tokens=max_new_tokens,
                             sampling=sampling, stop_token_ids=stop_token_ids)
