"""ZeRO stages 1-3 against plain data parallelism on the same devices.

Trains `gpt` (`--size`, default `mini`) on `--devices` logical CPUs (or the
GPUs there are) with `MirroredStrategy` and with `ShardedModel` at each
stage, through the same `Trainer`, and prints per run: the step time
(after a warm-up call that traces), its ratio to mirrored, and the bytes of
weights and optimizer slots on the device holding the most, read from where
each variable lives (mirrored: each replica's copy).

On logical CPUs the devices share the same cores: the ratios say what the
extra transfers and per-replica graphs cost here, not what a multi-GPU host
would see (docs/memory.md has the per-device estimate for those).

Usage:
  python scripts/bench_zero.py [--size=mini] [--devices=4] [--batch=32] \
      [--steps=6] [--optimizer=adam]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _mib(n: float) -> str:
  return f"{n / 2**20:.2f}"


def _data(size: str, rows: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  context = gpt.CONTEXTS[size]
  return (rng.randint(0, 256, (rows, context)).astype("int32"),
          rng.randint(0, 256, (rows, context)).astype("int32"))


def _run(label, model, strategy, args, x, y, held):
  """(label, seconds per step, max bytes of weights + slots per device)."""
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  trainer = Trainer(model, strategy=strategy, optimizer=args.optimizer,
                    verbose=0, metrics=[], steps_per_execution=args.steps)
  fit = lambda: trainer.fit(x, y, epochs=1, global_batch_size=args.batch,
                            steps_per_epoch=args.steps, shuffle=False)
  fit()  # Traces.
  start = time.perf_counter()
  fit()
  seconds = (time.perf_counter() - start) / args.steps
  return label, seconds, max(held(trainer.optimizer).values())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="mini")
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--optimizer", default="adam")
  args = parser.parse_args()
  import tfmgpu  # pylint: disable=g-import-not-at-top
  tfmgpu.configure_devices(logical_cpus=args.devices)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero  # pylint: disable=g-import-not-at-top
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top

  devices = tfmgpu.list_devices("CPU")[:args.devices]
  x, y = _data(args.size, args.batch * args.steps)

  def build():
    return models.build_model("gpt", input_shape=(gpt.CONTEXTS[args.size],),
                              num_classes=256, seed=0, size=args.size)

  strategy = tf.distribute.MirroredStrategy(devices)
  with strategy.scope():
    plain = build()

  def mirrored_bytes(optimizer):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    slots = [v for v in inner.variables
             if v is not inner.iterations and "learning_rate" not in v.path]
    held = zero.bytes_by_device(list(plain.weights) + slots)
    return {d: b for d, b in held.items()}

  rows = [_run("mirrored", plain, strategy, args, x, y, mirrored_bytes)]
  for stage in (1, 2, 3):
    sharded = zero.ShardedModel(build(), devices, stage=stage)
    rows.append(_run(
        f"zero stage {stage}", sharded, None, args, x, y,
        lambda opt, s=sharded: {d: b["weights"] + b["slots"]
                                for d, b in s.live_bytes(opt).items()}))
  base = rows[0][1]
  print(f"gpt {args.size}, {args.devices} devices, global batch "
        f"{args.batch}, {args.optimizer}, {args.steps} steps per call")
  print(f"{'layout':<14} {'step ms':>8} {'vs mirrored':>12} "
        f"{'max MiB weights+slots per device':>34}")
  for label, seconds, held in rows:
    print(f"{label:<14} {seconds * 1e3:8.1f} {seconds / base:11.2f}x "
          f"{_mib(held):>34}")


if __name__ == "__main__":
  main()
