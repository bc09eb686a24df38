"""The decode loop: prefill once, then one compiled step per position.

The loop follows keras_hub's `CausalLM.generate`: every row of a batch is
at the same position `index`; a row whose prompt is longer keeps its own
token there, the others get the sampled one. A step reads the token at
`index - 1`, writes its keys and values into the cache and chooses the
token at `index`. The state (token buffer, masks, cache) has the same
shapes at every step and `index` is a loop variable, so the loop traces
once per request shape, whether it runs every position in one call or
one position per call (streaming).

A model joins through a `CacheAdapter` (`gpt_cache.GPTCache`,
`hub_cache.HubCache`). Under a `tf.distribute.Strategy` the rows are split
over the replicas and each replica runs the loop on its own rows and cache
(`strategy.run`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Protocol

import numpy as np
import tensorflow as tf

from tfmgpu.generation import samplers

State = dict[str, Any]
Cache = tuple[tf.Tensor, ...]


class CacheAdapter(Protocol):
  """What the loop needs of a model: an empty cache, a prefill, a step.

  Attributes:
    max_positions: the longest sequence the model reads (`None`: no limit).
    vocab: the logits' width.
    prefills_whole_buffer: (optional, default False) prefill reads the
      whole token buffer (prompt + room for new tokens), as keras_hub's
      `generate` does, for a model whose prompt keys depend on the length
      it is called with (Phi3's "su" rotary scaling).
  """
  max_positions: int | None
  vocab: int

  def empty_cache(self, batch: int, length: int) -> Cache:
    """Zero keys and values for `batch` rows of `length` positions."""

  def prefill(self, token_ids: tf.Tensor, cache: Cache) -> Cache:
    """`cache` with the keys/values of positions `[0, T)` of `token_ids`."""

  def step(self, token: tf.Tensor, cache: Cache, index: tf.Tensor
           ) -> tuple[tf.Tensor, Cache]:
    """`(logits (B, vocab), cache)` of one token per row at `index`."""


def dim(t: tf.Tensor, axis: int) -> Any:
  """`t`'s size along `axis`: an int when known while tracing, else a
  scalar tensor (an exported signature takes any batch and width)."""
  size = t.shape[axis]
  return int(size) if size is not None else tf.shape(t)[axis]


def initial_state(prompt_ids: np.ndarray, lengths: np.ndarray, rows:
                  np.ndarray, width: int, max_new_tokens: int) -> State:
  """The state before prefill (no cache yet) for these rows, as numpy.

  Args:
    prompt_ids: `(B, P)` int32 prompts, right-padded.
    lengths: `(B,)` each prompt's length (>= 1).
    rows: `(B,)` each row's index in the whole request (for seeding).
    width: the token buffer's width (the longest prompt + new tokens).
    max_new_tokens: new tokens per row at most.
  """
  batch, prompt_width = prompt_ids.shape
  tokens = np.zeros((batch, width), np.int32)
  tokens[:, :prompt_width] = prompt_ids
  prompt = np.arange(width)[None, :] < lengths[:, None]
  return {"tokens": tokens, "prompt": prompt, "filled": prompt.copy(),
          "done": np.zeros(batch, bool), "rows": rows.astype(np.int32),
          "ends": (lengths + max_new_tokens).astype(np.int32)}


def prefill_function(adapter: CacheAdapter, prompt_width: int) -> Callable[..., Any]:
  """`prefill(state) -> state` with the cache of the prompts written."""

  whole = getattr(adapter, "prefills_whole_buffer", False)

  def prefill(state: State) -> State:
    tokens = state["tokens"]
    cache = adapter.empty_cache(dim(tokens, 0), dim(tokens, 1))
    cache = adapter.prefill(tokens if whole else tokens[:, :prompt_width],
                            cache)
    return dict(state, cache=cache)

  return prefill


def step_function(adapter: CacheAdapter, sampling: samplers.Sampling,
                  stop_token_ids: Sequence[int] | None
                  ) -> Callable[..., State]:
  """`step(state, index, seed) -> state`: fills position `index` of every
  row that is neither in its prompt nor done."""
  stops = tf.constant(list(stop_token_ids or []), tf.int32)

  def step(state: State, index: tf.Tensor, seed: tf.Tensor) -> State:
    tokens = state["tokens"]
    logits, cache = adapter.step(tf.gather(tokens, index - 1, axis=1),
                                 state["cache"], index - 1)
    chosen = samplers.next_tokens(logits, sampling, seed, state["rows"], index)
    write = tf.logical_not(tf.gather(state["prompt"], index, axis=1)
                           | state["done"])
    at = tf.equal(tf.range(dim(tokens, 1)), index)[None, :] & write[:, None]
    tokens = tf.where(at, chosen[:, None], tokens)
    stopped = tf.reduce_any(tf.equal(chosen[:, None], stops[None, :]), -1)
    done = state["done"] | (write & (stopped | (index + 1 >= state["ends"])))
    return dict(state, tokens=tokens, filled=state["filled"] | at, done=done,
                cache=cache)

  return step


def loop_function(step: Callable[..., State], stop_early: bool
                  ) -> Callable[..., State]:
  """`advance(state, index, stop, seed) -> state`: the step for positions
  `index .. stop - 1` in a `tf.while_loop`, ending early once every row is
  done when `stop_early`.

  The position is a loop variable, never a constant of the compiled code:
  XLA would compile a function again for each value of an argument that an
  op needs as a constant (keras_hub's position slices do), so even one
  position per call runs in this loop.
  """

  def advance(state: State, index: tf.Tensor, stop: tf.Tensor,
              seed: tf.Tensor) -> State:
    def going(i, s):
      more = i < stop
      return more & ~tf.reduce_all(s["done"]) if stop_early else more

    def body(i, s):
      return i + 1, step(s, i, seed)

    _, state = tf.while_loop(going, body, (index, state))
    return state

  return advance


def _explained(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, whose trace failing on a model's Python use of a tensor says
  that generation cannot run it (instead of TF's page on AutoGraph)."""

  def call(*args):
    try:
      return fn(*args)
    except tf.errors.OperatorNotAllowedInGraphError as e:
      said = next((re.sub(r"\x1b\[\d+m", "", line).strip()
                   for line in str(e).splitlines() if "not allowed" in line), "")
      raise ValueError(
          "This model's cached call cannot run in a TF graph: it uses a "
          "tensor as a Python bool or unpacks one (keras_hub 0.32's Gemma3, "
          "and Qwen with sliding-window attention; their own generate fails "
          "the same way on TensorFlow), so tfmgpu cannot generate with it. "
          f"TF said: {said[:200]}") from e

  return call


class Runner:
  """Runs prefill and the decode loop on one device, or on each replica's
  rows.

  Args:
    strategy: `None` (the current device), or a `tf.distribute.Strategy`
      whose replicas each take a contiguous share of the rows.
    jit_compile: compile the per-replica decode loop with XLA.
    device: where to run without a strategy (`None`: TF's choice).

  Under a strategy, each replica calls the compiled loop on its own device,
  reading its own copies of the weights: the model's must be made in the
  strategy's scope (`Generator` copies one made outside it).

  Attributes:
    traces: how many times a per-replica decode loop was traced.
    graphs: the graph of each trace (to read where its ops run).
  """

  def __init__(self, strategy: tf.distribute.Strategy | None,
               jit_compile: bool, device: str | None = None):
    self.strategy = strategy
    self.device = device
    self.jit_compile = jit_compile
    self.traces = 0
    self.graphs: list[tf.Graph] = []
    self._loops: dict[Any, Callable[..., Any]] = {}
    self._prefills: dict[Any, Callable[..., Any]] = {}

  @property
  def replicas(self) -> int:
    return self.strategy.num_replicas_in_sync if self.strategy else 1

  def compiled_loop(self, key: Any, make: Callable[[], Callable]
                    ) -> Callable[..., Any]:
    """The compiled decode loop for `key` (sampler, stops), made once."""
    if key not in self._loops:
      advance = make()

      def counted(state, index, stop, seed):
        self.traces += 1  # Runs only while tracing.
        self.graphs.append(tf.compat.v1.get_default_graph())
        return advance(state, index, stop, seed)

      inner = tf.function(counted, jit_compile=self.jit_compile)
      # Given a plain function, `strategy.run` calls `inner` in each
      # replica; given `inner` itself, TF compiles every replica's loop as
      # one XLA call on the first device, which cannot read the other
      # replicas' copies of the weights.
      each = lambda *a: inner(*a)
      self._loops[key] = _explained(
          self._on_device(inner) if self.strategy is None else
          tf.function(lambda *args: self.strategy.run(each, args=args)))
    return self._loops[key]

  def _on_device(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` called under `tf.device(self.device)` when one is set."""
    if self.device is None:
      return fn

    def placed(*args):
      with tf.device(self.device):
        return fn(*args)

    return placed

  def place(self, state: State) -> Any:
    """`state` as tensors, split by rows over the replicas."""
    if self.strategy is None:
      return tf.nest.map_structure(tf.convert_to_tensor, state)
    share = len(state["tokens"]) // self.replicas

    def part(context):
      r = context.replica_id_in_sync_group
      return tf.nest.map_structure(
          lambda a: tf.convert_to_tensor(a[r * share:(r + 1) * share]), state)

    return self.strategy.experimental_distribute_values_from_function(part)

  def prefill(self, key: Any, make: Callable[[], Callable[[State], State]],
              state: Any) -> Any:
    """`state` with its cache written, by the prefill for `key` (the
    prompt width), compiled once."""
    if key not in self._prefills:
      fn = make()
      self._prefills[key] = _explained(
          self._on_device(tf.function(fn)) if self.strategy is None else
          tf.function(lambda s: self.strategy.run(fn, args=(s,))))
    return self._prefills[key](state)

  def local(self, value: Any) -> np.ndarray:
    """A per-replica value's rows joined, in replica order, as numpy."""
    if self.strategy is None:
      return value.numpy()
    return np.concatenate([v.numpy() for v in
                           self.strategy.experimental_local_results(value)])


def positions(runner: Runner, advance: Callable[..., Any], state: Any,
              first: int, width: int, seed: int, *, each: bool,
              stop_early: bool) -> Iterator[tuple[int, Any]]:
  """Decodes positions `first .. width - 1`, yielding `(index, state)`:
  after each position when `each` (one call per position, for streaming),
  else once after one call for them all. Ends early once every row is
  done when `stop_early`."""
  seed = tf.constant(seed, tf.int32)
  if not each:
    yield width - 1, advance(state, tf.constant(first), tf.constant(width),
                             seed)
    return
  for index in range(first, width):
    state = advance(state, tf.constant(index), tf.constant(index + 1), seed)
    yield index, state
    if stop_early and runner.local(state["done"]).all():
      return
