"""Measuring a staged or pipelined model: stage times and stored activations.

`StageProbe` and `measure_stage_times` time each stage alone on one
micro-batch (forward, and backward), the per-stage times that
`tfmgpu.parallel.timeline.simulate` takes. `saved_activation_bytes` reads
from a traced `PipelinedModel` training step how many bytes each stage keeps
from its forward for its backward (what `recompute=True` saves).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfmgpu.parallel import pipeline
from tfmgpu.parallel import staged


def saved_activation_bytes(concrete_function) -> dict[int, int]:
  """Bytes each stage keeps from the forward phase for its backward.

  Reads the traced step (outer graph): a tensor counts for stage `k` when a
  backward op of stage `k` (its gradient ops, and with recomputation its
  recomputed forward) consumes it and a forward-phase op produced it.
  Variable reads, constants and resource handles are not activations and
  are not counted; neither are the whole-batch loss's own tensors. Each
  tensor counts once per stage. These tensors stay alive from the forward
  that makes them to the backward that consumes them.

  Args:
    concrete_function: a traced `PipelinedModel` training step.

  Returns:
    `{stage: bytes}` for every stage with a backward.

  Raises:
    ValueError: a counted tensor has an unknown shape (trace with a fixed
      batch size).
  """
  skip_types = {"ReadVariableOp", "Const", "VarHandleOp"}
  out: dict[int, int] = collections.defaultdict(int)
  seen: set[tuple[int, str]] = set()
  for op in concrete_function.graph.get_operations():
    k = pipeline.backward_stage(op.name)
    if k is None:
      continue
    out[k] += 0
    for t in op.inputs:
      producer = t.op.name
      if (pipeline.backward_stage(producer) is not None or "_loss/" in producer
          or t.op.type in skip_types or t.dtype in (tf.resource, tf.variant)
          or (k, t.name) in seen):
        continue
      seen.add((k, t.name))
      if not t.shape.is_fully_defined():
        raise ValueError(f"tensor {t.name} has shape {t.shape}; trace the "
                         "step with a fixed batch size to count bytes.")
      out[k] += t.shape.num_elements() * t.dtype.size
  return dict(sorted(out.items()))


class StageProbe:
  """Times each stage of a staged model alone on one micro-batch.

  Each stage runs on its device in its own `tf.function`: its forward, and
  its forward plus backward (with the loss on the last stage). Call
  `sample()` as often as needed, e.g. interleaved with other timings so that
  a change of machine load hits them all alike.
  """

  def __init__(self, model: staged.StagedModel, x, y, loss_fn, *,
               micro_batches: int | None = None):
    """Builds and traces the per-stage functions.

    Args:
      model: a `StagedModel` or `PipelinedModel`.
      x, y: one batch; its first `len(x) // micro_batches` rows are used.
      loss_fn: `loss_fn(y_true, y_pred)`, as for `compute_loss_and_gradients`.
      micro_batches: split of the batch. Defaults to the model's (1 for a
        `StagedModel`).
    """
    m = micro_batches or getattr(model, "micro_batches", 1)
    rows = len(x) // m
    h, y = tf.constant(x[:rows]), tf.constant(y[:rows])
    last = len(model.stages) - 1
    self.functions = []
    self.core_use: list[float] = []
    for k, (stage, device) in enumerate(zip(model.stages,
                                            model.stage_devices)):
      sources = [v.value for v in stage.trainable_variables]

      @tf.function
      def fwd(inp, stage=stage, device=device):
        with tf.device(device):
          return stage(inp, training=True)

      @tf.function
      def fwd_bwd(inp, stage=stage, device=device, k=k, sources=sources):
        with tf.device(device):
          with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(sources)
            if k > 0:  # As in the pipeline: no gradient for the model input.
              tape.watch(inp)
            out = stage(inp, training=True)
            if k == last:
              out = loss_fn(y, out)
          return tape.gradient(out, sources + ([inp] if k > 0 else []))

      self.functions.append((fwd, fwd_bwd, h))
      h = fwd(h)
    self.sample()  # Traces.

  def sample(self) -> tuple[list[float], list[float]]:
    """One timing of each stage: `(forward, forward_and_backward)` seconds.

    Also appends to `core_use` the cores this process kept busy meanwhile
    (its CPU seconds over the wall seconds): a stage alone may run its
    independent ops on several cores at once.
    """
    forward, both = [], []
    cpu, wall = time.process_time(), time.perf_counter()
    for fwd, fwd_bwd, inp in self.functions:
      for fn, out in ((fwd, forward), (fwd_bwd, both)):
        start = time.perf_counter()
        _ = [t.numpy() for t in tf.nest.flatten(fn(inp), expand_composites=True)
             if t is not None]
        out.append(time.perf_counter() - start)
    self.core_use.append((time.process_time() - cpu)
                         / max(time.perf_counter() - wall, 1e-9))
    return forward, both


def stage_times(samples: Sequence[tuple[list[float], list[float]]]
                ) -> tuple[list[float], list[float]]:
  """Per-stage `(forward, backward)` medians from `StageProbe.sample()`s.

  The backward is the median of forward-plus-backward minus the median
  forward (never below 0).
  """
  forward = np.median([s[0] for s in samples], axis=0)
  both = np.median([s[1] for s in samples], axis=0)
  return ([float(f) for f in forward],
          [float(max(b - f, 0.0)) for f, b in zip(forward, both)])


def measure_stage_times(model: staged.StagedModel, x, y, loss_fn, *,
                        micro_batches: int | None = None, repeats: int = 10,
                        warmup: int = 2) -> tuple[list[float], list[float]]:
  """Times each stage alone on one micro-batch: forward, and backward.

  These are the per-stage times that `timeline.simulate` takes. See
  `StageProbe` for how they are measured.

  Args:
    model: a `StagedModel` or `PipelinedModel`.
    x, y: one batch; its first `len(x) // micro_batches` rows are used.
    loss_fn: `loss_fn(y_true, y_pred)`, as for `compute_loss_and_gradients`.
    micro_batches: split of the batch. Defaults to the model's.
    repeats: timed runs (the median is kept). Defaults to 10.
    warmup: untimed runs first. Defaults to 2.

  Returns:
    `(forward_seconds, backward_seconds)`, one entry per stage.
  """
  probe = StageProbe(model, x, y, loss_fn, micro_batches=micro_batches)
  for _ in range(warmup):
    probe.sample()
  return stage_times([probe.sample() for _ in range(repeats)])
