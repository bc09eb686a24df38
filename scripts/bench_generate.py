r"""Benchmarks text generation on one device: tokens/s, side by side.

For each model and batch size (`--batches`), `--new_tokens` new tokens
after a `--prompt_len`-token prompt:

* `tfmgpu.generate`: prefill, then the compiled decode loop (KV cache);
* `tfmgpu stream`: the same, one position per call (what the CLI does);
* keras_hub's `CausalLM.generate` (greedy, XLA, its own KV cache), for
  the keras_hub model only;
* a loop without a cache: a compiled forward pass over the whole padded
  sequence for every new token (argmax of the last real position).

The models (random weights, greedy): a keras_hub `GPT2CausalLM` and
tfmgpu's `gpt`, both the shape of `gpt`'s `mini` size (4 layers, width
128, 4 heads) over 256 byte tokens. Each path runs twice to warm up, then
three rounds call every path in turn; each path's median is shown, and
whether its new tokens equal `tfmgpu.generate`'s.

  python scripts/bench_generate.py                 # batch 1 and 32
  python scripts/bench_generate.py --batches=1 --new_tokens=64

`--layouts` instead measures `gpt mini` placed by `hybrid.build_layout` on
4 logical CPU devices (unplaced, tensor 2, pipeline 2 with one request
group per stage, data 2 x tensor 2): tokens/s of the whole decode loop,
and the latency of each position streamed one call at a time (p50/p99).
Logical devices share the machine's cores: these figures show what a
layout costs in TF's work and copies, not what GPUs would gain.

  python scripts/bench_generate.py --layouts --new_tokens=32

The keras_hub comparison with issue 27's targets (>= 1.0x keras_hub's
`generate`, >= 3x the loop without a cache) is the suite's `generate`
section: `python -m tfmgpu.bench --sections=generate --replicas=1`.
"""

from __future__ import annotations

import argparse
import time

import tfmgpu

tfmgpu.quiet_tensorflow()  # TensorFlow without its C++ start-up lines.
import numpy as np  # noqa: E402  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # noqa: E402  # pylint: disable=g-import-not-at-top

VOCAB, LAYERS, WIDTH, HEADS = 256, 4, 128, 4


def _hub_model(context: int):
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
      hidden_dim=WIDTH, intermediate_dim=4 * WIDTH,
      max_sequence_length=context)
  lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
  lm.compile(sampler="greedy")
  return lm


def _gpt_model(context: int):
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  return models.build_model("gpt", input_shape=(context,), num_classes=VOCAB,
                            size="mini", seed=0)


def _timed(paths: dict, rounds: int = 3) -> dict:
  """`{name: (median seconds, output)}`: every path warmed up twice, then
  `rounds` rounds in turn (`tfmgpu.benchmarks.generation.interleaved`), so
  a busy moment of the machine falls on every path alike."""
  from tfmgpu.benchmarks import generation as bench  # pylint: disable=g-import-not-at-top
  seconds, outs = bench.interleaved(paths, rounds)
  return {name: (float(np.median(seconds[name])), outs[name]) for name in paths}


def _new_tokens(ids: np.ndarray, prompt_len: int, new: int) -> np.ndarray:
  return np.asarray(ids)[:, prompt_len:prompt_len + new]


def _forward(model, hub: bool):
  """The model's logits of a full-width batch, compiled with XLA."""
  if hub:
    return tf.function(lambda x: model({"token_ids": x, "padding_mask":
                                        tf.ones_like(x, tf.bool)}),
                       jit_compile=True)
  return tf.function(lambda x: model(x, training=False), jit_compile=True)


def _no_cache(model, forward, prompt: np.ndarray, new: int, hub: bool):
  """Greedy by a compiled forward over the whole width per new token."""
  batch, prompt_len = prompt.shape
  width = prompt_len + new
  pad = model.input_shape[-1] if not hub else width
  ids = np.zeros((batch, pad), np.int32)
  ids[:, :prompt_len] = prompt
  for position in range(prompt_len, width):
    logits = forward(tf.constant(ids))
    ids[:, position] = np.argmax(logits[:, position - 1].numpy(), -1)
  return ids


def _rows(model, prompt, new, hub):
  """(name, seconds, new tokens) of every path for one model and batch."""
  from tfmgpu import generation  # pylint: disable=g-import-not-at-top
  prompt_len = prompt.shape[1]
  generator = generation.Generator(model)
  forward = _forward(model, hub)
  paths = {
      "tfmgpu.generate": lambda: generator.generate(
          prompt, max_new_tokens=new)["token_ids"],
      "tfmgpu stream": lambda: np.concatenate(
          [prompt] + [t[:, None] for t, _ in generator.stream(
              prompt, max_new_tokens=new)][1:], axis=1),
  }
  if hub:
    wide = {"token_ids": np.pad(prompt, [(0, 0), (0, new)]),
            "padding_mask": np.arange(prompt_len + new)[None, :]
                            < prompt_len + np.zeros((len(prompt), 1))}
    paths["keras_hub generate"] = lambda: model.generate(
        wide, stop_token_ids=None)["token_ids"]
  paths["no-cache loop"] = lambda: _no_cache(model, forward, prompt, new, hub)
  return [(name, seconds, _new_tokens(out, prompt_len, new))
          for name, (seconds, out) in _timed(paths).items()]


LAYOUTS = {"unplaced": None, "tensor 2": {"tensor": 2},
           "pipeline 2": {"stages": 2, "micro_batches": 2},
           "data 2 x tensor 2": {"data": 2, "tensor": 2}}


def _layout_row(model, prompt, new):
  """`(tokens/s, p50 ms, p99 ms, new tokens)` of a (placed) model."""
  from tfmgpu import generation  # pylint: disable=g-import-not-at-top
  generator = generation.Generator(model, jit_compile=False)
  whole = lambda: generator.generate(prompt, max_new_tokens=new)["token_ids"]
  (seconds, out), = _timed({"whole": whole}, rounds=2).values()
  list(generator.stream(prompt, max_new_tokens=new))  # Warm.
  steps, last = [], time.perf_counter()
  for _ in generator.stream(prompt, max_new_tokens=new):
    now = time.perf_counter()
    steps.append(now - last)
    last = now
  ms = 1000 * np.array(steps[1:])  # Each position (after the prefill).
  return (len(prompt) * new / seconds, float(np.percentile(ms, 50)),
          float(np.percentile(ms, 99)), _new_tokens(out, prompt.shape[1], new))


def layouts_main(args) -> None:
  """Per-layout tokens/s and per-position latency of `gpt mini`."""
  import tfmgpu  # pylint: disable=g-import-not-at-top
  tfmgpu.configure_devices(logical_cpus=4)
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  model = _gpt_model(args.prompt_len + args.new_tokens)
  cpus = tfmgpu.list_devices("CPU")
  print(f"gpt mini, {args.new_tokens} new tokens after {args.prompt_len}, "
        "greedy, the loop without XLA (a stage's one-device blocks compile "
        "with it), 4 logical CPU devices sharing the machine's cores")
  print(f"{'layout':18} {'batch':>5} {'tokens/s':>9} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'same tokens':>11}")
  for batch in (int(b) for b in args.batches.split(",")):
    prompt = np.random.RandomState(batch).randint(
        1, VOCAB, (batch, args.prompt_len)).astype(np.int32)
    reference = None
    for name, sizes in LAYOUTS.items():
      placed = model if sizes is None else hybrid.build_layout(
          model, hybrid.Layout(**sizes), devices=cpus)
      rate, p50, p99, tokens = _layout_row(placed, prompt, args.new_tokens)
      reference = tokens if reference is None else reference
      same = "yes" if np.array_equal(tokens, reference) else "NO"
      print(f"{name:18} {batch:5d} {rate:9,.0f} {p50:7.2f} {p99:7.2f} "
            f"{same:>11}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", default="1,32")
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--models", default="hub,gpt",
                      help="hub (keras_hub GPT-2), gpt (tfmgpu's), or both")
  parser.add_argument("--layouts", action="store_true",
                      help="gpt mini placed by hybrid.build_layout instead")
  args = parser.parse_args()
  if args.layouts:
    layouts_main(args)
    return
  context = args.prompt_len + args.new_tokens
  print(f"{args.new_tokens} new tokens after {args.prompt_len}, greedy, one "
        f"device ({LAYERS} layers, width {WIDTH}, vocab {VOCAB})")
  print(f"{'model':10} {'batch':>5} {'path':20} {'tokens/s':>10} "
        f"{'ms/position':>12} {'vs tfmgpu':>9} {'same tokens':>11}")
  chosen = args.models.split(",")
  for name, build, hub in (("GPT2 (hub)", _hub_model, True),
                           ("gpt mini", _gpt_model, False)):
    if ("hub" if hub else "gpt") not in chosen:
      continue
    model = build(context)
    for batch in (int(b) for b in args.batches.split(",")):
      prompt = np.random.RandomState(batch).randint(
          1, VOCAB, (batch, args.prompt_len)).astype(np.int32)
      rows = _rows(model, prompt, args.new_tokens, hub)
      ours = rows[0][1]
      for path, seconds, tokens in rows:
        same = "yes" if np.array_equal(tokens, rows[0][2]) else "NO"
        print(f"{name:10} {batch:5d} {path:20} "
              f"{batch * args.new_tokens / seconds:10,.0f} "
              f"{1000 * seconds / args.new_tokens:12.2f} "
              f"{ours / seconds:8.2f}x {same:>11}")


if __name__ == "__main__":
  main()
