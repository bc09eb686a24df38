"""Tokens per second of `gpt` under hybrid layouts, beside a GPU projection.

Each layout of `LAYOUTS` (data x pipeline x tensor sizes, a
`tfmgpu.parallel.hybrid.Layout`) trains the same `gpt` (same size, seed and
initial weights) on the same `stdlib_text` windows with the same global
batch, through the registered placement that builds it (`placement_of`:
`mirrored` for data parallelism alone, `tensor_parallel` for shards with or
without copies, `pipeline` for stages with copies and shards), by tfmgpu's
`Trainer`. `prepare` builds a layout and runs a first `fit` of the timed
length (tracing its step: later fits of that length reuse it); each call of
what it returns then times one more `fit`, the median step time of its
calls, so that the suite can interleave the layouts' rounds. Ratios are
taken against data parallelism (`mirrored`) on the same number of devices:
`reference(devices)`. A process's logical devices are fixed when it starts
(the bench's `--virtual_devices`, else its largest `--replicas`): the
section times the groups of `LAYOUTS` that fit (`groups`) and names the
others; `--virtual_devices=8` runs both groups in one process.

`projection_model` builds the larger `gpt` that
`tfmgpu.benchmarks.projection.project_layout` predicts each layout's step
of on a GPU host (weight shapes only: no weights are allocated).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras

from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu.benchmarks import language_model as lm_lib
from tfmgpu.benchmarks import training as training_lib
from tfmgpu.parallel import links
from tfmgpu.parallel.hybrid import Layout

# The layouts timed on each number of logical devices; the first of each
# group is data parallelism (`mirrored`), the group's reference.
LAYOUTS: dict[int, tuple[Layout, ...]] = {
    4: (Layout(data=4), Layout(tensor=2), Layout(tensor=4),
        Layout(data=2, tensor=2),
        Layout(stages=2, tensor=2, micro_batches=4),
        Layout(data=2, stages=2, micro_batches=4)),
    8: (Layout(data=8),
        Layout(data=2, stages=2, tensor=2, micro_batches=4),
        Layout(data=4, tensor=2),
        Layout(stages=4, tensor=2, micro_batches=8)),
}

# The model each mode trains: `(size, overrides)`. Quick mode's `tiny` gets
# 4 heads (it has 2) so that tensor=4 can split its attention, and one
# block (it has 2): tracing each layout's step is most of the section's
# time, and a block's graph is what each layout splits.
QUICK_MODEL = ("tiny", {"num_heads": 4, "num_layers": 1})
FULL_MODEL = ("mini", {})

# What the projection predicts: this size at its own context length.
PROJECTION_SIZE = "gpt2_small"
PROJECTION_HOST = "dgx_a100"


def reference(devices: int) -> Layout:
  """Data parallelism on `devices` devices: the ratios' denominator."""
  return Layout(data=devices)


def label(layout: Layout) -> str:
  """E.g. `data 2 x pipeline 2 (M=4) x tensor 2`, `data 4 (mirrored)`."""
  if layout.stages == 1 and layout.tensor == 1:
    return f"data {layout.data} (mirrored)"
  parts = [f"data {layout.data}"] if layout.data > 1 else []
  if layout.stages > 1:
    micro = ""
    if layout.micro_batches:
      schedule = "" if layout.schedule == "gpipe" else f" {layout.schedule}"
      micro = f" (M={layout.micro_batches}{schedule})"
    parts.append(f"pipeline {layout.stages}{micro}")
  if layout.tensor > 1:
    parts.append(f"tensor {layout.tensor}")
  return " x ".join(parts)


def placement_of(layout: Layout) -> lm_lib.Layout:
  """The registered strategy or placement, and its options, that train
  `layout` (what `--strategy` and its flags would name)."""
  if layout.stages == 1 and layout.tensor == 1:
    return lm_lib.Layout(label(layout), "mirrored",
                         {"num_replicas": layout.data})
  if layout.stages == 1:
    return lm_lib.Layout(label(layout), "tensor_parallel",
                         {"tensor_parallel": layout.tensor,
                          "data_parallel": layout.data})
  options = {"num_stages": layout.stages, "data_parallel": layout.data,
             "tensor_parallel": layout.tensor}
  if layout.micro_batches is None:
    return lm_lib.Layout(label(layout), "model_parallel", options)
  return lm_lib.Layout(label(layout), "pipeline", {
      **options, "micro_batches": layout.micro_batches,
      "schedule": layout.schedule, "recompute": layout.recompute})


def groups(max_devices: int) -> tuple[dict[int, tuple[Layout, ...]],
                                      list[int]]:
  """`LAYOUTS` split into the groups that fit on `max_devices` devices and
  the device counts of those that do not."""
  fit = {n: layouts for n, layouts in LAYOUTS.items() if n <= max_devices}
  return fit, [n for n in LAYOUTS if n > max_devices]


def prepare(layout: Layout, arrays: data_lib.Arrays, *, size: str,
            overrides: dict[str, Any] | None = None, global_batch_size: int,
            steps: int, steps_per_execution: int, seed: int = 0
            ) -> Callable[[], training_lib.Timing]:
  """Builds `layout`'s model and `Trainer` and traces its step.

  Args:
    layout: the sizes (`LAYOUTS`).
    arrays: the `stdlib_text` windows (`language_model.text_arrays`).
    size, overrides: the `gpt` size and its overrides (e.g. `num_heads`).
    global_batch_size: examples per step over all replicas.
    steps: steps per timed `fit` (rounded to whole calls, at least 3).
    steps_per_execution: steps per call.
    seed: the model's and the data order's seed.

  Returns:
    A function that trains one more `fit` of `steps` and returns its
    `Timing` (the median step of its calls).
  """
  run = lm_lib.layout_runner(
      placement_of(layout), arrays, size=size, overrides=overrides,
      global_batch_size=global_batch_size, steps=steps,
      steps_per_execution=steps_per_execution, seed=seed)
  run(0)  # Traces the step; fits of the same length reuse it.
  return functools.partial(run, 0)


def projection_model(size: str = PROJECTION_SIZE,
                     num_classes: int = 256) -> keras.Model:
  """`gpt` of `size` at its context length, weight shapes only (for the
  cost model: no weights are allocated)."""
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top
  from tfmgpu.placements import model_parallel  # pylint: disable=g-import-not-at-top
  return model_parallel.build_for_plan(lambda: models_lib.build_model(
      "gpt", input_shape=(gpt.CONTEXTS[size],), num_classes=num_classes,
      seed=0, size=size))


def projection_words(size: str = PROJECTION_SIZE,
                     host: str = PROJECTION_HOST) -> str:
  """What the projection is of, e.g. `gpt2_small (T=1024, 256-byte
  vocabulary) on one dgx_a100 (8 x 80 GB GPUs, nvlink_a100 300 GB/s)`."""
  from tfmgpu.models import gpt  # pylint: disable=g-import-not-at-top
  h = links.host(host)
  return (f"{size} (T={gpt.CONTEXTS[size]}, 256-byte vocabulary) on one "
          f"{host} ({h.gpus} x {h.memory_gb:g} GB GPUs at "
          f"{h.flops_per_s / 1e12:g} TFLOP/s sustained (assumed), {h.link} "
          f"{links.GPU_LINKS[h.link]:g} GB/s)")
