"""Text generation on one device: `tfmgpu.generate` beside keras_hub's own.

The suite's `generate` section (`python -m tfmgpu.bench
--sections=generate`): a keras_hub `GPT2CausalLM` with random weights, the
shape of `gpt`'s `mini` size (4 layers, width 128, 4 heads, 256 byte
tokens), `new_tokens` greedy tokens after a 16-token prompt, per batch
size, three paths called in turn each round (so a busy moment of the
shared machine falls on every path alike) after two warm-up calls each:

* `tfmgpu.generate`: prefill, then the compiled decode loop (KV cache);
* keras_hub's `CausalLM.generate` (greedy, XLA, its own KV cache);
* a loop without a cache: a compiled forward pass over the whole padded
  sequence per new token (argmax of the last real position).

Each path's new tokens must equal `tfmgpu.generate`'s. Issue 27's targets:
tokens/s >= 1.0x keras_hub's `generate` and >= 3x the loop without a
cache. `scripts/bench_generate.py` measures the same paths (and `gpt`'s
own cache, streaming, and placed layouts) as a script.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfmgpu import generation
from tfmgpu.benchmarks import report as report_lib

VOCAB, LAYERS, WIDTH, HEADS, PROMPT = 256, 4, 128, 4, 16
OURS, HUB, NO_CACHE = "tfmgpu.generate", "keras_hub generate", "no-cache loop"
TARGETS = {HUB: 1.0, NO_CACHE: 3.0}


def hub_model(context: int) -> Any:
  """A random-weight keras_hub GPT-2 of `gpt` mini's shape, greedy."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
      hidden_dim=WIDTH, intermediate_dim=4 * WIDTH,
      max_sequence_length=context)
  lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
  lm.compile(sampler="greedy")
  return lm


def _no_cache(model: Any, prompt: np.ndarray, new: int) -> Callable[[], Any]:
  """Greedy by a compiled forward over the whole width per new token."""
  forward = tf.function(lambda x: model(
      {"token_ids": x, "padding_mask": tf.ones_like(x, tf.bool)}),
                        jit_compile=True)
  batch, length = prompt.shape

  def run():
    ids = np.zeros((batch, length + new), np.int32)
    ids[:, :length] = prompt
    for position in range(length, length + new):
      logits = forward(tf.constant(ids))
      ids[:, position] = np.argmax(logits[:, position - 1].numpy(), -1)
    return ids
  return run


def paths(model: Any, prompt: np.ndarray, new: int
          ) -> dict[str, Callable[[], np.ndarray]]:
  """`{path: call}`, each returning `(B, prompt + new)` token ids."""
  generator = generation.Generator(model)
  length = prompt.shape[1]
  wide = {"token_ids": np.pad(prompt, [(0, 0), (0, new)]),
          "padding_mask": np.arange(length + new)[None, :]
                          < np.full((len(prompt), 1), length)}
  return {
      OURS: lambda: generator.generate(prompt, max_new_tokens=new)[
          "token_ids"],
      HUB: lambda: np.asarray(model.generate(
          wide, stop_token_ids=None)["token_ids"]),
      NO_CACHE: _no_cache(model, prompt, new)}


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int
                ) -> tuple[dict[str, list[float]], dict[str, Any]]:
  """`({path: seconds of each round}, {path: last output})`: two warm-up
  calls each (the first compiles), then `rounds` rounds in turn."""
  for fn in calls.values():
    fn()
    fn()
  seconds = {name: [] for name in calls}
  outs = {}
  for _ in range(rounds):
    for name, fn in calls.items():
      start = time.perf_counter()
      outs[name] = fn()
      seconds[name].append(time.perf_counter() - start)
  return seconds, outs


def _report_batch(report: report_lib.Report, batch: int, new: int,
                  seconds: dict[str, list[float]],
                  outs: dict[str, Any]) -> None:
  """One batch size's lines, rows and targets."""
  ours = min(seconds[OURS])
  for name, times in seconds.items():
    best = min(times)
    same = np.array_equal(outs[name][:, PROMPT:PROMPT + new],
                          outs[OURS][:, PROMPT:PROMPT + new])
    report.add(report_lib.Row(
        "generate", "gpt2_hub_mini", batch, name, 1000 * best / new,
        batch * new / best, "tokens/s; same tokens" if same
        else "tokens/s; OTHER TOKENS", [1000 * t for t in times]))
    report.say(f"  {batch:>5} {name:<20} {batch * new / best:>10,.0f} "
               f"{1000 * best / new:>12.2f} {best / ours:>8.2f}x "
               f"{'yes' if same else 'NO':>5}")
  for name, bound in TARGETS.items():
    report.figure(
        f"generate GPT-2 batch {batch}: tfmgpu tokens/s / {name}",
        min(seconds[name]) / ours,
        spread=report_lib.round_ratios(seconds[name], seconds[OURS]),
        target=report_lib.Target(bound))


def section(report: report_lib.Report, opts: Any, arrays: Any) -> None:
  """The suite's `generate` section (see the module)."""
  del arrays  # Random prompts of byte tokens.
  new = 128
  batches = (1,) if opts.quick else (1, 32)
  rounds = max(3, opts.rounds)
  report.header(f"Generation: {new} greedy tokens after {PROMPT}, one "
                f"device, keras_hub GPT-2 ({LAYERS} layers, width {WIDTH}, "
                f"vocab {VOCAB}), best of {rounds} interleaved rounds")
  report.say(f"  {'batch':>5} {'path':<20} {'tokens/s':>10} "
             f"{'ms/position':>12} {'tfmgpu x':>9} {'same':>5}")
  model = hub_model(PROMPT + new)
  for batch in batches:
    prompt = np.random.RandomState(batch).randint(
        1, VOCAB, (batch, PROMPT)).astype(np.int32)
    seconds, outs = interleaved(paths(model, prompt, new), rounds)
    _report_batch(report, batch, new, seconds, outs)
