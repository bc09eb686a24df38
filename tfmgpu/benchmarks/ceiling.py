"""The compute ceiling: achieved training FLOP/s against float32 matmul.

`matmul_gflops` measures what this machine's cores can do; `measure_ceiling`
trains each model on one device, through tfmgpu's loop and the bare loop,
and converts examples/s into FLOP/s with `training_flops_per_example`.
Single-device training gets every core, so a process that has split its CPU
into logical devices measures the ceiling in a fresh child process
(`measure_ceiling_in_child`, through `benchmarks.child`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
from tfmgpu import models as models_lib
from tfmgpu.benchmarks import child
from tfmgpu.benchmarks import training
from tfmgpu.parallel import cost as cost_lib
from tfmgpu.parallel import graph as graph_lib


def matmul_gflops(n: int = 1024, repeats: int = 20,
                  chains: int | None = None) -> float:
  """This machine's float32 matmul throughput (GFLOP/s), all cores.

  Runs `chains` independent chains of `repeats` matmuls at once (default:
  one per core), so the figure is the machine's whether TensorFlow gives an
  op every core or one thread (as `configure_devices` does for a split CPU).
  """
  chains = chains or devices_lib.cpu_cores()
  a = tf.random.uniform((chains, n, n), seed=1)
  b = tf.random.uniform((n, n), seed=2)

  @tf.function
  def run(a, b):
    total = tf.constant(0.0)
    for i in range(chains):
      c = a[i]
      for _ in range(repeats):
        c = tf.matmul(c, b) * 1e-3  # Scale keeps values finite.
      total += tf.reduce_sum(c)
    return total

  float(run(a, b))
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    float(run(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 * repeats * chains / best / 1e9


def training_flops_per_example(model: keras.Model) -> int:
  """Forward FLOPs counted layer by layer, times 3 (backward is ~2x forward)."""
  graph = graph_lib.ModelGraph(model)
  return 3 * sum(cost_lib.node_flops(n) for n in graph.nodes)


def measure_ceiling(models: Sequence[str], *, global_batch_size: int,
                    steps: int, steps_per_execution: int,
                    arrays: data_lib.Arrays | None = None,
                    batches: Sequence[int] | None = None,
                    rounds: int = 3) -> dict[str, Any]:
  """The matmul ceiling and each model's single-device training FLOP/s,
  through tfmgpu's loop and the bare loop, at each of `batches` (default:
  `global_batch_size` and 1024): each path built once, then timed in
  `rounds` interleaved rounds, its best kept.

  Returns:
    `{"gflops": ceiling, "runs": [{"model", "batch", "path", "ms_per_step",
    "examples_per_sec", "achieved_gflops"}, ...]}` (JSON-ready).
  """
  if arrays is None:  # A child process loads the suite's data itself.
    arrays = data_lib.load_dataset("digits")
  result: dict[str, Any] = {"gflops": matmul_gflops(), "runs": []}
  for model_name in models:
    model = models_lib.build_model(model_name, input_shape=arrays.input_shape,
                                   num_classes=arrays.num_classes)
    flops = training_flops_per_example(model)
    for batch in batches or (global_batch_size, 1024):
      big = batch > 256
      kwargs = dict(global_batch_size=batch,
                    steps=max(steps // 4, 8) if big else steps,
                    steps_per_execution=2 if big else steps_per_execution)
      built = {"tfmgpu": training.prepare_tfmgpu(
          tf.distribute.get_strategy(), model_name, arrays, **kwargs),
               "floor": training.prepare_floor(model_name, arrays, **kwargs)}
      for t in training.interleaved(built, rounds).values():
        result["runs"].append(dict(
            model=model_name, batch=batch, path=t.path,
            ms_per_step=t.ms_per_step, examples_per_sec=t.examples_per_sec,
            achieved_gflops=flops * t.examples_per_sec / 1e9))
  return result


def measure_ceiling_in_child(timeout_s: int = 900, **kwargs) -> dict[str, Any]:
  """`measure_ceiling(**kwargs)` in a child process that keeps every core.

  Raises:
    RuntimeError: the child process failed or took over `timeout_s` seconds.
  """
  return child.call_in_child(
      "tfmgpu.benchmarks.ceiling:measure_ceiling", kwargs,
      timeout_s=timeout_s, what="the ceiling measurement",
      alone="python -m tfmgpu.bench --sections=ceiling --replicas=1 "
      "--virtual_devices=1")
