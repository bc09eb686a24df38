"""The plan's training-memory estimate for the `gpt` sizes at K = 1, 2, 4, 8.

For each size it builds the model's layers and weight shapes only (no weight
values: `gpt2_xl` takes a second, not 6 GB), plans K stages with the exact
partitioner, and prints, per K, the device that must fit: its weights,
gradients and optimizer slots, one micro-batch's activations, and its total
under GPipe and 1F1B, with and without recomputation
(`StagePlan.memory_estimate`). Then one plan's full per-device table.

These are estimates from layer shapes (float32, no framework workspace,
fragmentation or temporaries of one op); docs/memory.md quotes a run and
says what has been validated.

Usage:
  python scripts/gpt_memory.py [--seq_len=1024] [--batch=8] \
      [--micro_batches=8] [--optimizer=adam] [--sizes=gpt2_small,...] \
      [--stages=1,2,4,8] [--detail=gpt2_small:8]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SCHEDULES = (("gpipe", False), ("gpipe", True), ("1f1b", False),
             ("1f1b", True))
VOCAB = 256  # Bytes.


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


def build(size: str, seq_len: int):
  """`gpt(size)` on `(seq_len,)` byte tokens: layers and weight shapes only."""
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import graph  # pylint: disable=g-import-not-at-top
  return graph.shapes_only(lambda: gpt.gpt((seq_len,), VOCAB, size=size))


def plan(model, num_stages: int):
  """The balanced `StagePlan` of `model` on `num_stages` devices named
  `/device:GPU:0..` (not required to exist)."""
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  return partition.plan_stages(
      model, num_stages, devices=[f"/gpu:{i}" for i in range(num_stages)],
      check_devices=False)


def row(stage_plan, batch: int, micro_batches: int,
        optimizer: str) -> list[str]:
  """`K`, the largest stage's weights, gradients, slots, one micro-batch's
  activations, and the largest device total for each of `SCHEDULES` (GiB)."""
  first = stage_plan.memory_estimate(batch, optimizer=optimizer)
  big = max(first.values(), key=lambda e: e.weights)
  micro = batch // micro_batches
  one = max(micro * (s.input_bytes + s.activation_bytes)
            for s in stage_plan.stages)
  totals = []
  for schedule, recompute in SCHEDULES:
    est = stage_plan.memory_estimate(batch, optimizer=optimizer,
                                     micro_batches=micro_batches,
                                     schedule=schedule, recompute=recompute)
    totals.append(_gib(max(e.total for e in est.values())))
  return [str(stage_plan.num_stages), _gib(big.weights), _gib(big.gradients),
          _gib(big.optimizer_slots), _gib(one)] + totals


def markdown(sizes, stages, *, seq_len: int, batch: int, micro_batches: int,
             optimizer: str) -> str:
  """The table for `sizes` x `stages`, as Markdown."""
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top
  header = ["size", "params", "K", "weights", "grads", f"{optimizer} slots",
            "activations / micro-batch", "GPipe", "GPipe + recompute",
            "1F1B", "1F1B + recompute"]
  lines = ["| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
  for size in sizes:
    params = gpt.parameter_count(size, VOCAB, seq_len)
    model = build(size, seq_len)
    for k in stages:
      cells = [size, f"{params / 1e6:.0f}M"] + row(
          plan(model, k), batch, micro_batches, optimizer)
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--micro_batches", type=int, default=8)
  parser.add_argument("--optimizer", default="adam")
  parser.add_argument("--sizes", default="gpt2_small,gpt2_medium,"
                      "gpt2_large,gpt2_xl")
  parser.add_argument("--stages", default="1,2,4,8")
  parser.add_argument("--detail", default="gpt2_small:8",
                      help="SIZE:K whose per-device table to print too "
                      "(empty: none).")
  args = parser.parse_args(argv)
  stages = [int(k) for k in args.stages.split(",")]
  print(f"gpt, T={args.seq_len}, vocab {VOCAB}, float32, batch {args.batch} "
        f"= {args.micro_batches} micro-batches; GiB on the device that must "
        "fit (weights, grads, slots: the largest stage's).\n")
  print(markdown(args.sizes.split(","), stages, seq_len=args.seq_len,
                 batch=args.batch, micro_batches=args.micro_batches,
                 optimizer=args.optimizer))
  if args.detail:
    size, k = args.detail.split(":")
    detail = plan(build(size, args.seq_len), int(k))
    print(f"\n{size}, K={k}:\n\n{detail}\n")
    print(detail.memory_table(args.batch, optimizer=args.optimizer,
                              micro_batches=args.micro_batches,
                              schedule="1f1b", recompute=True))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
