"""One pipelined training step: every (stage, micro-batch) task's ops, in order.

`PipelineStep` builds the graph of one `PipelinedModel` training step. It
walks the tasks in the order `tfmgpu.parallel.schedule.build_order` gives for
the schedule and creates each task's ops under its stage's device:

* the forward `F(k, m)` runs stage `k` on micro-batch `m` (under a tape,
  unless the step recomputes);
* under `"gpipe"`, the last stage's first backward first computes the whole
  batch's loss once and seeds every micro-batch's backward with its gradient;
* the backward `B(k, m)` (re-running the forward first with recomputation)
  differentiates the stage with the gradient from stage `k + 1` and sends
  the gradient of its input to stage `k - 1`;
* at the end each stage sums its variables' gradients over the micro-batches
  and adds its weight regularisation, once.

Each device's tasks are chained by control dependencies, in the order its
in-order stream would run them (with `virtual_stages > 1`, interleaved 1F1B,
a device runs the tasks of several non-consecutive stages, in
`schedule.device_orders`'s order). The ops' name scopes
(`FORWARD_SCOPE`, `RECOMPUTE_SCOPE`, `BACKWARD_SCOPE`; `BACKWARD_OP` matches
a backward op's name) are how tests and `tfmgpu.benchmarks.pipeline` read a
traced step.
"""

from __future__ import annotations

import collections
import contextlib
import re
import weakref
from collections.abc import Sequence
from typing import Any, Callable

from absl import logging
import keras
import tensorflow as tf

from tfmgpu.parallel import microbatch
from tfmgpu.parallel import placed
from tfmgpu.parallel import schedule as schedule_lib
from tfmgpu.parallel import shared

LOSS_REDUCTIONS = ("sum", "mean")

# Name scopes of the traced step.
FORWARD_SCOPE = "stage_{k}_mb_{m}"
RECOMPUTE_SCOPE = "stage_{k}_recompute_mb_{m}"
BACKWARD_SCOPE = "stage_{k}_backward_mb_{m}"
# The name of an op of stage `k`'s backward (its gradient ops and, with
# recomputation, its recomputed forward); `k` is group 1 or group 2.
BACKWARD_OP = re.compile(
    r"^(?:gradient_tape/)?stage_(\d+)_(?:backward_|recompute_)mb_\d+/"
    r"|^gradient_tape/stage_(\d+)_mb_\d+/")


class PipelineStep:
  """Builds the ops of one pipelined forward/backward (see the module doc).

  One object per traced step: `run` creates every op and returns the loss,
  the outputs and the summed gradients.
  """

  def __init__(self, stages: Sequence[keras.Model], devices: Sequence[str], *,
               micro_batches: int, schedule: str, recompute: bool,
               loss_fn: placed.LossFn,
               scale: Callable[[tf.Tensor], tf.Tensor],
               loss_reduction: str, virtual_stages: int = 1):
    """Holds the stages and the options; creates no op.

    Args:
      stages: the stage models, `stages[k]` on `devices[k]`.
      devices: one device per stage.
      micro_batches: `M`: the batch splits into `M` near-equal parts
        (`microbatch.part_sizes`; a batch of fewer rows is refused).
      schedule: `"gpipe"` or `"1f1b"`.
      recompute: re-run each stage's forward in its backward.
      loss_fn: `loss_fn(y_true, y_pred)`, the scalar loss (see
        `PipelinedModel.compute_loss_and_gradients`).
      scale: applied to each stage's regularisation losses.
      loss_reduction: `"sum"` or `"mean"`: how `"1f1b"` combines the
        per-micro-batch losses.
      virtual_stages: `V`: stage `k` runs on the device of stage `k % K`
        (`K = len(stages) / V`), in interleaved 1F1B order. Defaults to 1.

    Raises:
      ValueError: an unknown `loss_reduction`.
    """
    if loss_reduction not in LOSS_REDUCTIONS:
      raise ValueError(f"loss_reduction={loss_reduction!r} is unknown; use "
                       f"{' or '.join(map(repr, LOSS_REDUCTIONS))}.")
    self.stages, self.devices = list(stages), list(devices)
    self.micro_batches, self.schedule = micro_batches, schedule
    self.recompute, self.loss_fn, self.scale = recompute, loss_fn, scale
    self.mean = loss_reduction == "mean"
    # Per micro-batch: the batch's rows over its rows (`M` for equal parts).
    self.divisors: list[Any] = [float(micro_batches)] * micro_batches
    self.last = len(self.stages) - 1
    self.gpipe = schedule == schedule_lib.Schedule.GPIPE.value
    self.virtual_stages = virtual_stages
    self.num_devices = len(self.stages) // virtual_stages
    K = len(self.stages)
    self.xs: list[Any] = []
    self.ys: list[Any] | None = None
    self.y = None
    self.inputs, self.outs, self.tapes = {}, {}, {}
    self.objectives, self.upstream = {}, {}
    self.grads = [collections.defaultdict(list) for _ in range(K)]
    # Per device: the outputs of its last task (what its next one waits on).
    self.done: list[list[Any]] = [[] for _ in range(self.num_devices)]
    self.totals: list[Any] = []
    self.y_pred = None

  def run(self, x, y, checks: Sequence[Any]):
    """Builds the step on a batch.

    Args:
      x: the batch of inputs.
      y: its targets.
      checks: ops that must run before the batch is split (run-time checks
        of its size).

    Returns:
      `(loss, y_pred, grads)`: the differentiated objective, the outputs of
      all micro-batches in order, and `{id(variable): gradient}` for every
      trainable variable of the stages.
    """
    self._split_batch(x, y, checks)
    K, M = len(self.stages), self.micro_batches
    orders = schedule_lib.device_orders(self.num_devices, M, self.schedule,
                                        virtual_stages=self.virtual_stages)
    deps = lambda t: schedule_lib.dependencies(t, K, M, self.schedule)
    for task in schedule_lib.build_order(orders, deps):
      if task.kind == schedule_lib.FORWARD:
        self._forward(task.stage, task.micro_batch)
      else:
        self._backward(task.stage, task.micro_batch)
    if self.y_pred is None:
      with tf.device(self.devices[self.last]):
        self.y_pred = microbatch.concat(
            [self.outs[(self.last, i)] for i in range(M)])
    summed = self._accumulate()
    with tf.device(self.devices[self.last]):
      total = tf.add_n([tf.cast(t, keras.config.floatx())
                        for t in self.totals])
    return total, self.y_pred, summed

  def _lane(self, k: int) -> int:
    """The device (its in-order stream) that runs stage `k`."""
    return k % self.num_devices

  def _split_batch(self, x, y, checks: Sequence[Any]) -> None:
    """Splits the inputs on the first stage (and, for 1F1B, the targets on
    the last); under GPipe the targets stay whole for the one loss."""
    M = self.micro_batches
    with tf.device(self.devices[0]), tf.name_scope("micro_batches"), \
        tf.control_dependencies(checks):
      self.xs = microbatch.split(x, M, uneven=True)
      self.divisors = microbatch.part_divisors(x, M)
    self.y = y
    if not self.gpipe:
      with tf.device(self.devices[self.last]), \
          tf.name_scope("micro_targets"), tf.control_dependencies(checks):
        self.ys = microbatch.split(y, M, uneven=True)

  def _loss_term(self, k: int, m: int):
    """Micro-batch `m`'s loss as a function of its output (1F1B's last
    stage), or `None`."""
    if k != self.last or self.gpipe:
      return None
    return lambda out: self._micro_batch_loss(m, out)

  def _micro_batch_loss(self, m: int, out) -> Any:
    """1F1B: micro-batch `m`'s share of the loss.

    Raises:
      ValueError: the losses are averaged (`"mean"`) over micro-batches but
        the output carries a Keras mask: each micro-batch's loss is then a
        mean over its own unmasked entries, and their mean is not the
        batch's.
    """
    if self.mean and microbatch.carries_mask(out):
      raise ValueError(
          "schedule='1f1b' averages the per-micro-batch losses "
          "(loss_reduction='mean'), but the model's output carries a Keras "
          "mask (e.g. from Embedding(mask_zero=True)): each micro-batch "
          "would be averaged over its own unmasked entries, which differs "
          "from the unsplit loss. Use schedule='gpipe' (one loss on the whole "
          "batch), micro_batches=1, or a loss with reduction='sum'.")
    loss = self.loss_fn(self.ys[m], out)
    return self._share(loss, m) if self.mean else loss

  def _share(self, value, m: int):
    """Micro-batch `m`'s share of a per-row mean `value`: divided by the
    batch's rows over its own (`microbatch.part_divisors`), in `value`'s
    dtype (a float64 model's too)."""
    return microbatch.divide(value, self.divisors[m])

  def _run_stage(self, k: int, m: int, inp, *, record: bool,
                 loss_term=None):
    """Runs stage `k` on one micro-batch (training); with `record`, under a
    tape.

    Returns:
      `(tape, output, objective)`: `objective` is this micro-batch's share
      of the call losses (and of the loss, via `loss_term(output)`), or
      `None`.
    """
    stage = self.stages[k]
    sources = [v.value for v in stage.trainable_variables]
    tape = tf.GradientTape(watch_accessed_variables=False) if record else None
    with tape if record else contextlib.nullcontext():
      if record:
        tape.watch(sources)
        if k > 0:
          tape.watch(placed.differentiable(inp))
      out = stage(inp, training=True)
      objective = None
      calls = microbatch.call_losses(stage)
      if calls and self.micro_batches > 1:
        _warn_call_losses(stage, k, self.micro_batches)
      if calls:
        total = tf.add_n([tf.cast(tf.reduce_sum(l), keras.config.floatx())
                          for l in calls])
        objective = self._share(self.scale(total), m)
      if loss_term is not None:
        term = loss_term(out)
        objective = term if objective is None else term + objective
    return tape, out, objective

  def _forward(self, k: int, m: int) -> None:
    """`F(k, m)`: stage `k` on micro-batch `m`, after the stage's last task."""
    inp = self.xs[m] if k == 0 else self.outs[(k - 1, m)]
    with tf.device(self.devices[k]), tf.name_scope(
        FORWARD_SCOPE.format(k=k, m=m)), tf.control_dependencies(
            self.done[self._lane(k)]):
      tape, out, objective = self._run_stage(
          k, m, inp, record=not self.recompute, loss_term=self._loss_term(k, m))
    self.inputs[(k, m)], self.outs[(k, m)] = inp, out
    self.tapes[(k, m)], self.objectives[(k, m)] = tape, objective
    self.done[self._lane(k)] = (
        tf.nest.flatten(out) + ([objective] if objective is not None else []))
    if objective is not None:
      self.totals.append(objective)

  def _seed_from_batch_loss(self) -> None:
    """GPipe: the whole batch's loss, once, on the last stage; its gradient
    with respect to each micro-batch's output seeds that backward."""
    k, M = self.last, self.micro_batches
    with tf.device(self.devices[k]), tf.name_scope(f"stage_{k}_loss"):
      last_outs = [self.outs[(k, i)] for i in range(M)]
      watched = [placed.differentiable(o) for o in last_outs]
      with tf.GradientTape(watch_accessed_variables=False) as loss_tape:
        loss_tape.watch(watched)
        self.y_pred = microbatch.concat(last_outs) if M > 1 else last_outs[0]
        loss = self.loss_fn(self.y, self.y_pred)
      seeds = loss_tape.gradient(loss, watched)
      for i, (outs, grads) in enumerate(zip(watched, seeds)):
        self.upstream[(k, i)] = placed.input_gradients(grads, outs,
                                                       self.devices[k])
    self.totals.append(loss)

  def _backward(self, k: int, m: int) -> None:
    """`B(k, m)`: differentiates stage `k` on micro-batch `m` once its
    upstream gradient has arrived; sends its input's gradient upstream."""
    if k == self.last and self.gpipe and self.y_pred is None:
      self._seed_from_batch_loss()
    inp = self.inputs.pop((k, m))
    grad_out = self.upstream.pop((k, m), [])
    result = self._differentiate(k, m, inp, grad_out)
    num_vars = len(self.stages[k].trainable_variables)
    if k > 0:
      self.upstream[(k - 1, m)] = placed.input_gradients(
          result[num_vars:], placed.differentiable(inp), self.devices[k])
    result = result[:num_vars]
    for i, g in enumerate(result):
      self.grads[k][i].append(g)
    signals = [getattr(g, "values", g) for g in result if g is not None]
    lane = self._lane(k)
    self.done[lane] = (signals + (self.upstream[(k - 1, m)] if k > 0 else [])
                       or self.done[lane])

  def _differentiate(self, k: int, m: int, inp, grad_out: list[Any]
                     ) -> list[Any]:
    """The gradients of stage `k`'s variables (then, when `k > 0`, of its
    input's floating-point tensors) on micro-batch `m`, recomputing its
    forward first if asked. `grad_out`: the gradients of its output's
    floating-point tensors (empty on the last stage)."""
    tape, out = self.tapes.pop((k, m)), self.outs[(k, m)]
    objective = self.objectives.pop((k, m))
    device = self.devices[k]
    with tf.control_dependencies(self.done[self._lane(k)] + list(grad_out)):
      if self.recompute:
        with tf.device(device), tf.name_scope(
            RECOMPUTE_SCOPE.format(k=k, m=m)):
          tape, out, objective = self._run_stage(
              k, m, inp, record=True, loss_term=self._loss_term(k, m))
      sources = [v.value for v in self.stages[k].trainable_variables]
      result = placed.backward_on_device(
          tape, device, BACKWARD_SCOPE.format(k=k, m=m),
          outputs=placed.differentiable(out) if grad_out else [],
          output_gradients=grad_out, objective=objective,
          sources=sources + (placed.differentiable(inp) if k > 0 else []))
    del tape
    return result

  def _accumulate(self) -> dict[int, Any]:
    """Sums each variable's micro-batch gradients on its stage's device and
    adds the weight regularisation (once per step). A weight shared between
    stages gets the sum of every stage's gradient."""
    pairs = []
    for k, (stage, device) in enumerate(zip(self.stages, self.devices)):
      variables = stage.trainable_variables
      with tf.device(device), tf.name_scope(f"stage_{k}_accumulate"):
        summed = [microbatch.sum_parts(self.grads[k][i])
                  for i in range(len(variables))]
      sources = [v.value for v in variables]
      with tf.device(device), tf.name_scope(f"stage_{k}_regularization"):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
          tape.watch(sources)
          terms = microbatch.weight_regularization(stage)
          reg = (self.scale(tf.add_n([tf.cast(t, keras.config.floatx())
                                      for t in terms]))
                 if terms else None)
      if reg is not None:
        self.totals.append(reg)
        reg_grads = placed.backward_on_device(
            tape, device, f"stage_{k}_backward_regularization", outputs=[],
            output_gradients=[], objective=reg, sources=sources)
        with tf.device(device), tf.name_scope(f"stage_{k}_accumulate"):
          summed = [microbatch.sum_gradients([g, r])
                    for g, r in zip(summed, reg_grads)]
      pairs.extend(zip(variables, summed))
    return shared.sum_by_variable(pairs)


_WARNED: "weakref.WeakSet[keras.Model]" = weakref.WeakSet()


def _warn_call_losses(stage: keras.Model, k: int, micro_batches: int) -> None:
  """Says once per stage (at trace time) that its call losses are averaged
  over micro-batches: exact for per-example means, not for a batch
  statistic (a mixture-of-experts load-balancing loss). Names the stage's
  own layers that add them, copies named as the user's layers (a sublayer
  of a copy bears a name of Keras' making: `mixtral_sparse_moe_block_2`
  for the user's `mixtral_sparse_moe_block`)."""
  # Activity regularisers are per example, weighted by rows: exact.
  adders = microbatch.loss_adders(stage)
  if stage in _WARNED or not adders:
    return
  _WARNED.add(stage)
  logging.warning(
      "Pipeline stage %d: losses added in call() by %s are computed per "
      "micro-batch and averaged over the %d micro-batches. That equals the "
      "whole batch's loss when each is a mean over examples; a batch "
      "statistic (a mixture-of-experts load-balancing loss) trains "
      "differently from the unsplit model. Use micro_batches=1 (model "
      "parallelism) to train it exactly.", k, f"layers {', '.join(adders)}",
      micro_batches)

