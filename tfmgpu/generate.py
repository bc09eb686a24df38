r"""Generate text with a trained causal LM: `python -m tfmgpu.generate`.

Examples:
  python -m tfmgpu.generate --model_path=runs/X/model.keras \
      --prompt="import " --max_new_tokens=200
  python -m tfmgpu.generate --model_path=lm.keras --prompt_ids=1,5,9 \
      --sampler=top_k --top_k=40 --sample_seed=1

Placements place the model as for `predict` (e.g. `--strategy=pipeline
--num_stages=2`, `--strategy=tensor_parallel --tensor_parallel=2`): each
layer's KV cache stays on its devices (a keras_hub model's: each
block's). A `gpt` trained on `stdlib_text` reads bytes: `--prompt` is text
and the new tokens print as text as they come. Other models take `--prompt_ids`
and print token ids. Past the model's context, generation goes on in
windows (the last half of the context becomes the next prompt).
"""

from __future__ import annotations

import codecs
import os
import sys
import time
import types

from absl import app
from absl import flags

from tfmgpu import flags as flags_lib
from tfmgpu.flags import cli
from tfmgpu.flags import devices
from tfmgpu.flags import serving
from tfmgpu.flags import stages
from tfmgpu.flags import strategy as strategy_flags

for _group in (strategy_flags, stages, devices, serving):
  flags.adopt_module_key_flags(_group)  # `--help` lists them too.

_PROMPT = flags.DEFINE_string(
    "prompt", None, "Text to continue (byte-level models: one token per "
    "UTF-8 byte).")
_PROMPT_IDS = flags.DEFINE_list(
    "prompt_ids", None, "Token ids to continue, e.g. 1,5,9 (instead of "
    "--prompt).")
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 200, "Tokens to write at most.", lower_bound=1)
_SAMPLER = flags_lib.define_choice(
    "sampler", "greedy", ["greedy", "top_k", "top_p", "random"],
    "How the next token is chosen.", module_name=__name__)
_TOP_K = flags.DEFINE_integer("top_k", 40, "k of --sampler=top_k.",
                              lower_bound=1)
_TOP_P = flags.DEFINE_float("top_p", 0.9, "p of --sampler=top_p.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Divides the logits before sampling (not greedy).")
_SAMPLE_SEED = flags.DEFINE_integer(
    "sample_seed", None, "Seed of the sampler: the same seed writes the same "
    "text. Defaults to a fresh one.", lower_bound=-2**31,
    upper_bound=2**31 - 1)
_STOP_TOKEN_IDS = flags.DEFINE_list(
    "stop_token_ids", None, "Stop after any of these token ids.")
_MEMORY_PLAN = flags.DEFINE_bool(
    "memory_plan", False, "Print each device's weights and KV cache for "
    "--serve_batch rows of the prompt (if given) + --max_new_tokens "
    "positions, at most the model's own, under the placement flags; "
    "generate nothing.")
_SERVE_BATCH = flags.DEFINE_integer(
    "serve_batch", 1, "Request rows --memory_plan and --serve plan for.",
    lower_bound=1)
_SERVE = flags_lib.define_choice(
    "serve", None, ["latency", "throughput"], "Print the layouts weighed "
    "to generate with on the devices found (weights + KV cache per device, "
    "predicted decode step) and the one chosen for this goal; generate "
    "nothing.", module_name=__name__)

BYTE_VOCAB = 256


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if not serving.MODEL_PATH.value or len(serving.MODEL_PATH.value) != 1:
    raise app.UsageError("--model_path is required: one .keras file, e.g. "
                         "runs/X/model.keras from python -m tfmgpu.train "
                         "--model_dir=runs/X.")
  planning = _MEMORY_PLAN.value or _SERVE.value
  if _PROMPT.value is not None and _PROMPT_IDS.value is not None:
    raise app.UsageError('Give only one of --prompt="text" or '
                         '--prompt_ids=1,2,3, not both.')
  if not planning and _PROMPT.value is None and _PROMPT_IDS.value is None:
    raise app.UsageError('Give one of --prompt="text" or --prompt_ids=1,2,3.')
  unread = _unread_sampling_flag()
  if unread:
    raise app.UsageError(unread)
  flags_lib.quiet_tensorflow()
  try:
    if planning:
      print(_serving_plan() if _SERVE.value else _memory_plan())
      return 0
    generator, as_text = _prepare()
    prompt = _prompt_tokens(as_text, generator.adapter.vocab)
    return _write(generator, prompt, as_text)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1


# The samplers that read each sampling flag.
_READ_BY = {"top_k": ("top_k",), "top_p": ("top_p",),
            "temperature": ("top_k", "top_p", "random"),
            "sample_seed": ("top_k", "top_p", "random")}


def _unread_sampling_flag() -> str | None:
  """Why a sampling flag given is one `--sampler` does not read, or `None`
  (`--top_k=5` with the default greedy sampler wrote greedy text,
  silently: a new user's trial)."""
  for name, readers in _READ_BY.items():
    flag = flags.FLAGS[name]
    given = flag.present or flag.value != flag.default
    if given and _SAMPLER.value not in readers:
      needs = " or ".join(f"--sampler={r}" for r in readers)
      return (f"--{name}={flag.value} is read only by {needs}, and "
              f"--sampler={_SAMPLER.value} is in use: add {needs.split()[0]}"
              f" (or drop --{name}).")
  return None


def _prepare():
  """Devices, the model and its `Generator`; whether it reads bytes."""
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu import generation  # pylint: disable=g-import-not-at-top
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  from tfmgpu import strategies as strategies_lib  # pylint: disable=g-import-not-at-top
  values = strategy_flags.values()
  distribution = strategies_lib.lookup(values.pop("strategy"))
  devices_lib.configure_virtual_devices(
      devices.VIRTUAL_DEVICES.value,
      intra_op_threads=distribution.intra_op_threads)
  model = inference.load_model(serving.MODEL_PATH.value[0])
  options = distribution.options_from(
      types.SimpleNamespace(**values, **stages.values()))
  model, strategy = distribution.serve([model], options)
  generator = generation.Generator(model, strategy=strategy)
  return generator, generator.adapter.vocab == BYTE_VOCAB


def _memory_plan() -> str:
  """`kv_cache.serving_table` of the model under the placement flags."""
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  from tfmgpu import strategies as strategies_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import kv_cache  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import layout as layout_lib  # pylint: disable=g-import-not-at-top
  values = strategy_flags.values()
  distribution = strategies_lib.lookup(values.pop("strategy"))
  devices_lib.configure_virtual_devices(devices.VIRTUAL_DEVICES.value)
  model = inference.load_model(serving.MODEL_PATH.value[0])
  options = distribution.options_from(
      types.SimpleNamespace(**values, **stages.values()))
  layout = distribution.layout_of(options) or layout_lib.Layout()
  # This host's devices when it has enough, else the GPUs it plans for.
  found = devices_lib.accelerator_devices()
  return kv_cache.serving_table(
      model, layout, batch=_SERVE_BATCH.value, context=_context(model),
      devices=found if len(found) >= layout.num_devices else None)


def _context(model) -> int:
  """The prompt's tokens (if given) + --max_new_tokens, at most the
  positions `model` reads (a longer text slides its window over them)."""
  from tfmgpu.generation import api  # pylint: disable=g-import-not-at-top
  prompt = (len(_PROMPT_IDS.value) if _PROMPT_IDS.value is not None
            else len((_PROMPT.value or "").encode("utf-8")))
  limit = api.adapter_for(model).max_positions
  wanted = prompt + _MAX_NEW_TOKENS.value
  return wanted if limit is None else min(wanted, limit)


def _serving_plan() -> str:
  """`serve_plan.weigh_serving` on the devices found, as `auto` sees them."""
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import serve_plan  # pylint: disable=g-import-not-at-top
  from tfmgpu.placements import auto  # pylint: disable=g-import-not-at-top
  devices_lib.configure_virtual_devices(devices.VIRTUAL_DEVICES.value)
  model = inference.load_model(serving.MODEL_PATH.value[0])
  hardware = auto.hardware_for(auto.AutoOptions(),
                               devices_lib.accelerator_devices())
  context = _context(model)
  weighed = serve_plan.weigh_serving(
      model, hardware, batch=_SERVE_BATCH.value, context=context,
      goal=_SERVE.value)
  return serve_plan.format_serving(weighed, hardware, goal=_SERVE.value,
                                   context=context)


def _prompt_tokens(as_text: bool, vocab: int) -> list[int]:
  """The prompt's token ids, each checked against the model's `vocab`."""
  if _PROMPT_IDS.value is not None:
    from tfmgpu.generation import prompts  # pylint: disable=g-import-not-at-top
    given = f"--prompt_ids={','.join(_PROMPT_IDS.value)}"
    try:
      ids = [int(t) for t in _PROMPT_IDS.value]
    except ValueError as e:
      raise ValueError(f"{given} must be integer token ids, e.g. 1,5,9.") from e
    prompts.check_ids(ids, vocab, given)
    return ids
  if not as_text:
    raise ValueError(f"--prompt is text, read as UTF-8 bytes by a model of "
                     f"{BYTE_VOCAB} tokens; this model's vocabulary has "
                     f"{vocab}: give its token ids with --prompt_ids (from "
                     "the tokenizer it was trained with).")
  return list(_PROMPT.value.encode("utf-8"))


def _write(generator, prompt: list[int], as_text: bool) -> int:
  """Prints the prompt, then each new token as it comes, then the rate."""
  from tfmgpu import generation  # pylint: disable=g-import-not-at-top
  sampling = generation.Sampling(
      _SAMPLER.value, k=_TOP_K.value if _SAMPLER.value == "top_k" else None,
      p=_TOP_P.value if _SAMPLER.value == "top_p" else None,
      temperature=_TEMPERATURE.value, seed=_SAMPLE_SEED.value)
  stops = [int(t) for t in _STOP_TOKEN_IDS.value or []]
  decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
  show = ((lambda ids: decoder.decode(bytes(ids))) if as_text
          else (lambda ids: "".join(f"{t} " for t in ids)))
  cut = generation.prompt_cut(generator, prompt)
  if cut:  # Said, not done silently.
    print(f"note: the prompt's {len(prompt)} tokens are more than the "
          f"model's {len(prompt) - cut + 1} positions hold with a new token: "
          f"it continues from the last {len(prompt) - cut} (the first {cut} "
          "are not read).", file=sys.stderr)
  sys.stdout.write(show(prompt))
  count, start = 0, time.perf_counter()
  for token in generation.stream_tokens(
      generator, prompt, max_new_tokens=_MAX_NEW_TOKENS.value,
      sampling=sampling, stop_token_ids=stops):
    sys.stdout.write(show([token]))
    sys.stdout.flush()
    count += 1
  seconds = time.perf_counter() - start
  sys.stdout.write(decoder.decode(b"", final=True) if as_text else "")
  print(f"\n[{count} tokens in {seconds:.2f} s: {count / seconds:,.1f} "
        "tokens/s, compile included]", file=sys.stderr)
  return 0


def run() -> None:
  """Console-script entry point (`tfmgpu-generate`)."""
  cli.run(main, __name__)


class _CliAndFunction(types.ModuleType):
  """`tfmgpu.generate` names both this CLI module and the public function
  `tfmgpu.generation.generate`: calling it generates (a path given as the
  model is loaded for the call, as `tfmgpu.predict` does) and `.main` runs
  the CLI."""

  def __call__(self, model, *args, **kwargs):
    from tfmgpu import generation  # pylint: disable=g-import-not-at-top
    from tfmgpu import inference  # pylint: disable=g-import-not-at-top
    if isinstance(model, (str, os.PathLike)):  # As tfmgpu.predict loads one.
      model = inference.load_model(os.fspath(model))
    return generation.generate(model, *args, **kwargs)


sys.modules[__name__].__class__ = _CliAndFunction

if __name__ == "__main__":
  run()
