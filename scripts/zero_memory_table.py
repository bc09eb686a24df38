"""ZeRO stages 0-3 per GPU for the keras_hub shapes (and `gpt` sizes).

For each model it builds the layers with weight shapes only (no values:
`graph.shapes_only`, so an 8B model takes seconds, not 32 GB), accounts
each ZeRO stage over the 8 GPUs of a named host
(`tfmgpu.parallel.zero_memory.account`: weights, summed gradients, Adam's
slots, float32, activations not counted), and prints a markdown table: the
largest device's GiB per stage, and whether it fits the hosts' GPUs
(`links.GPU_HOSTS`: 80 GB A100/H100, 24 GB A10).

Usage:
  python scripts/zero_memory_table.py [--models=llama:llama3_8b,...] \
      [--devices=8] [--optimizer=adam]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = ("gpt:gpt2_xl", "gpt2:gpt2_large", "qwen:qwen2_5_0_5b",
          "gemma:gemma_2b", "llama:llama2_7b", "qwen:qwen2_5_7b",
          "llama:llama3_8b", "gemma:gemma_7b")


def sizes_of(model_name: str, size: str) -> tuple[list[int], list[bool]]:
  """Bytes and trainability of each weight of `model_name` at `size`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu import models  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import graph  # pylint: disable=g-import-not-at-top
  context = 1024
  model = graph.shapes_only(lambda: models.build_model(
      model_name, input_shape=(context,), num_classes=256, size=size))
  seen, sizes, trainable = set(), [], []
  for v in model.weights:
    if id(v) not in seen:
      seen.add(id(v))
      sizes.append(int(tf.TensorShape(v.shape).num_elements())
                   * tf.as_dtype(v.dtype).size)
      trainable.append(bool(v.trainable))
  return sizes, trainable


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--optimizer", default="adam")
  args = parser.parse_args()
  from tfmgpu.parallel import links  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero_memory  # pylint: disable=g-import-not-at-top
  hosts = sorted({(h.memory_gb, h.name) for h in links.GPU_HOSTS.values()})
  gib = 2**30
  print("| model | params | stage | weights | gradients | slots | total "
        "per GPU | sent per step | fits |")
  print("|---|---|---|---|---|---|---|---|---|")
  for entry in args.models.split(","):
    name, size = entry.split(":")
    sizes, trainable = sizes_of(name, size)
    devices = [f"/device:GPU:{i}" for i in range(args.devices)]
    params = sum(sizes) / 4 / 1e9
    for stage in (0, 1, 2, 3):
      rows = zero_memory.account(sizes, trainable, devices, stage,
                                 args.optimizer)
      top = max(rows, key=lambda r: r.total)
      fits = ", ".join(n for gb, n in hosts if top.total <= gb * 1e9) or "-"
      label = (f"{name} {size}", f"{params:.2f} B") if stage == 0 else ("", "")
      print(f"| {label[0]} | {label[1]} | {stage} | {top.weights / gib:.2f} "
            f"| {top.gradients / gib:.2f} | {top.slots / gib:.2f} "
            f"| {top.total / gib:.2f} | {max(r.sent for r in rows) / gib:.2f}"
            f" | {fits} |", flush=True)


if __name__ == "__main__":
  main()
