"""ZeRO beside plain data parallelism: step time and the bytes each device
holds (issue 28).

The suite's `zero` section (`python -m tfmgpu.bench --sections=zero`):
`gpt` on the same logical devices (up to 4), the same windows of
`stdlib_text`, seed and batch, trained by tfmgpu's `Trainer` as
`mirrored` and as `mirrored --zero_stage=1` and `3` (stage 2 runs stage
1's step: `tfmgpu.parallel.zero`), each path's rounds interleaved. Per
device, the weights and optimizer slots are read from where each variable
actually lives (`zero_shards.bytes_by_device`; a mirrored variable counts
once on each of its devices); the table prints the fullest device's bytes
and its fraction of mirrored's, beside the step time's ratio to mirrored.
Logical CPUs share the host's cores, so the time ratio measures what ZeRO's
sends and reads cost, not a speed-up.
"""

from __future__ import annotations

import functools
from typing import Any

from tfmgpu import devices as devices_lib
from tfmgpu.benchmarks import language_model as lm_lib
from tfmgpu.benchmarks import report as report_lib
from tfmgpu.benchmarks import training as training_lib
from tfmgpu.parallel import zero_shards

STAGES = (1, 3)
SEQ_LEN, STEPS_PER_EXECUTION = 64, 2


def held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
  """`{device: weight and slot bytes it holds}`, read from the variables
  (the optimizer's step counter and learning rate left out)."""
  own = getattr(model, "live_bytes", None)
  if own is not None:  # A ShardedModel: owners and stage-1 copies.
    return {d: b["weights"] + b["slots"] for d, b in own(optimizer).items()}
  return zero_shards.bytes_by_device(
      list(model.weights) + zero_shards.optimizer_slots(optimizer))


def layouts(replicas: int) -> list[lm_lib.Layout]:
  """Mirrored (the reference) and each ZeRO stage of `STAGES`."""
  return [lm_lib.Layout(f"mirrored x{replicas}", "mirrored",
                        {"num_replicas": replicas})] + [
      lm_lib.Layout(f"zero {s} x{replicas}", "mirrored",
                    {"num_replicas": replicas, "zero_stage": s})
      for s in STAGES]


def section(report: report_lib.Report, opts: Any, arrays: Any) -> None:
  """Times each layout of `layouts` and prints the table."""
  del arrays  # Trains on stdlib_text.
  replicas = min(4, len(devices_lib.accelerator_devices()))
  size = "tiny" if opts.quick else "mini"
  report.header(f"ZeRO: gpt {size} step time and bytes per device beside "
                "mirrored on the same devices")
  if replicas < 2:
    report.say("  skipped: one device (--virtual_devices=4 gives four)")
    return
  text = lm_lib.text_arrays(SEQ_LEN)
  runs = {}
  held = {}
  for layout in layouts(replicas):
    run = lm_lib.layout_runner(
        layout, text, size=size, global_batch_size=opts.global_batch_size,
        steps=6 if opts.quick else 12,
        steps_per_execution=STEPS_PER_EXECUTION)
    run(0)  # Traces the step (and builds the optimizer's slots).
    held[layout.label] = max(held_bytes(run.trainer.model,
                                        run.trainer.optimizer).values())
    runs[layout.label] = functools.partial(run, 1)
  best = training_lib.interleaved(runs, opts.rounds)
  _rows(report, size, replicas, best, held)


def _rows(report: report_lib.Report, size: str, replicas: int,
          best: dict[str, training_lib.Timing], held: dict[str, int]) -> None:
  ref = f"mirrored x{replicas}"
  report.say(f"  (Adam, T={SEQ_LEN}, steps_per_execution="
             f"{STEPS_PER_EXECUTION}; time vs mirrored: its ms/step over "
             "this one's, lowest-highest of one round; bytes: the fullest "
             "device's weights and slots)")
  report.say(f"  {'layout':<14} {'ms/step':>8}  {'time vs mirrored':<18} "
             f"{'MiB held':>9} {'vs mirrored':>11}")
  figures = []
  for name, t in best.items():
    speed = best[ref].ms_per_step / t.ms_per_step
    spread = None if name == ref else report_lib.round_ratios(
        best[ref].rounds_ms, t.rounds_ms)
    fraction = held[name] / held[ref]
    report.say(f"  {name:<14} {t.ms_per_step:>8.1f}  "
               f"{report_lib.with_spread(speed, spread):<18} "
               f"{held[name] / 2**20:>9.2f} {fraction:>11.2f}")
    report.add(report_lib.Row(
        "zero", f"gpt_{size}", replicas, name, t.ms_per_step,
        lm_lib.tokens_per_sec(t, SEQ_LEN),
        f"vs mirrored x{speed:.3f}; fullest device {held[name]} bytes "
        f"({fraction:.2f} of mirrored)", t.rounds_ms))
    if name != ref:
      figures += [(f"{name}: speed vs mirrored", speed, spread),
                  (f"{name}: fullest device's bytes / mirrored's", fraction,
                   None)]
  for name, value, spread in figures:
    report.figure(name, value, "(measured)", spread=spread)
