"""Pipeline parallelism: micro-batches streamed through device-placed stages.

`PipelinedModel` is a `StagedModel` whose training step splits the batch into
`M` micro-batches. Stage `k`'s forward `F(k, m)` and backward `B(k, m)` run
under stage `k`'s device; the graph is unrolled in Python, one block of ops
per (stage, micro-batch, direction), so TF's executor runs `F(k, m)` on
device `k` while `F(k + 1, m - 1)` runs on device `k + 1`: nothing in the
dataflow ties them together. Each stage's own tasks are chained in the
schedule's order (`tfmgpu.parallel.schedule.stage_orders`) by control
dependencies, as a device's in-order stream would run them. Gradients are
summed over micro-batches on each stage's device and applied once, so one
pipelined step equals one unsplit step on the whole batch:

* `"gpipe"`: the loss is computed once, on the last stage's device, on the
  outputs of all micro-batches concatenated in order, and its gradient with
  respect to each micro-batch's output seeds that micro-batch's backward.
  The objective is literally the unsplit one, whatever `loss_fn` averages
  over (the global batch, the batch it is given, sample weights).
* `"1f1b"`: the last stage runs `B(K-1, m)` right after `F(K-1, m)`, so the
  loss is computed per micro-batch and combined by `loss_reduction`:
  `"sum"` when `loss_fn` divides by a fixed global batch size (what
  `tf.nn.compute_average_loss(..., global_batch_size=G)` does, and what
  tfmgpu's Trainer passes), `"mean"` when it averages over the rows it is
  given (a Keras loss with its default reduction; `fit` picks this for you).
  The control dependencies guarantee that stage `k` starts the forward of
  micro-batch `m + K - k` only after the backward of micro-batch `m` has
  finished on it, so it holds at most `min(K - k, M)` micro-batches of
  activations (TF frees a tensor when its last consumer has run).

Regularisation: weight regularisers are counted once per step (their own
small backward per stage); losses added during a call (activity
regularisers, which Keras divides by the batch size, and `add_loss`) are
averaged over the micro-batches.

`recompute=True` keeps only each stage's input per micro-batch: the forward
runs without a tape, and the backward re-runs the stage forward under its
device (after its upstream gradient has arrived, so the executor cannot hoist
it into the forward phase) and differentiates that. `saved_activation_bytes`
reads from the traced graph what each stage keeps for its backward.

Known differences from unsplit training: BatchNormalization sees micro-batch
statistics (and updates its moving averages once per micro-batch; twice with
recompute), and random layers such as Dropout draw new randomness when a
stage is recomputed.

Inference (`call`, `predict`, `evaluate`) streams the micro-batches through
the stages the same way and concatenates the outputs in order. A batch that
`micro_batches` does not divide is zero-padded to the next multiple and the
padding's outputs are dropped (inference only: training raises).
"""

from __future__ import annotations

import collections
import contextlib
import re
from typing import Any, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfmgpu.parallel import placed
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import schedule as schedule_lib
from tfmgpu.parallel import staged

FORWARD, BACKWARD = schedule_lib.FORWARD, schedule_lib.BACKWARD
LOSS_REDUCTIONS = ("sum", "mean")

# Name scopes of the traced step (see `saved_activation_bytes`).
_FORWARD_SCOPE = "stage_{k}_mb_{m}"
_RECOMPUTE_SCOPE = "stage_{k}_recompute_mb_{m}"
_BACKWARD_SCOPE = "stage_{k}_backward_mb_{m}"
_BACKWARD_OP = re.compile(
    r"^(?:gradient_tape/)?stage_(\d+)_(?:backward_|recompute_)mb_\d+/"
    r"|^gradient_tape/stage_(\d+)_mb_\d+/")


def _check_micro_batches(micro_batches: Any) -> int:
  if (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
      or micro_batches < 1):
    raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1 "
                     "(e.g. micro_batches=4; 1 turns pipelining off).")
  return micro_batches


def _split(structure: Any, num: int) -> list[Any]:
  """Splits every tensor of a structure along axis 0 into `num` parts."""
  flat = tf.nest.flatten(structure)
  parts = [[None] * num if t is None else tf.split(t, num, axis=0)
           for t in flat]
  return [tf.nest.pack_sequence_as(structure, [p[m] for p in parts])
          for m in range(num)]


def _sum_gradients(grads: Sequence[Any]) -> Any:
  """Adds one variable's gradients from several micro-batches."""
  grads = [g for g in grads if g is not None]
  if not grads:
    return None
  if len(grads) == 1:
    return grads[0]
  if any(isinstance(g, tf.IndexedSlices) for g in grads):
    slices = [g if isinstance(g, tf.IndexedSlices) else
              tf.IndexedSlices(g, tf.range(tf.shape(g)[0]), tf.shape(g))
              for g in grads]
    return tf.IndexedSlices(tf.concat([s.values for s in slices], 0),
                            tf.concat([s.indices for s in slices], 0),
                            slices[0].dense_shape)
  return tf.add_n(grads)


def _call_losses(stage: keras.Model) -> list[Any]:
  """The losses added by the stage's last call (activity regularisers etc.).

  `Layer.losses` lists those first and then recomputes one term per
  regularised weight; the weight terms are counted once per step elsewhere.
  """
  losses = stage.losses
  weighted = sum(1 for v in stage.trainable_weights
                 if getattr(v, "regularizer", None) is not None)
  return losses[:len(losses) - weighted]


def _weight_regularization(stage: keras.Model) -> list[Any]:
  return [v.regularizer(v) for v in stage.trainable_weights
          if getattr(v, "regularizer", None) is not None]


class PipelinedModel(staged.StagedModel):
  """A `StagedModel` that pipelines micro-batches through its stages.

  Example:

    model = tfmgpu.models.demo.deep_mlp((784,), 10)
    pipe = tfmgpu.parallel.PipelinedModel.from_model(
        model, num_stages=4, micro_batches=8, schedule="1f1b")
    pipe.compile(optimizer="adam", loss=...)
    pipe.fit(x, y, batch_size=256)      # batch_size divisible by 8

  Attributes:
    micro_batches: micro-batches per step (`M`).
    schedule: `"gpipe"` or `"1f1b"`.
    recompute: re-run each stage's forward in its backward instead of
      keeping its activations.
  """

  places_itself = True

  def __init__(self, model: keras.Model, plan: plan_lib.StagePlan, *,
               micro_batches: int = 4, schedule: str = "gpipe",
               recompute: bool = False, name: str | None = None, **kwargs):
    """Builds the stages from `model`'s layers and copies its weights.

    Args:
      model: the unsplit, built Sequential or functional model (untouched).
      plan: a `StagePlan` for this model (from `plan_stages`).
      micro_batches: micro-batches per step; the training batch size must
        be a multiple. Defaults to `4`.
      schedule: `"gpipe"` or `"1f1b"` (see the module docstring). Defaults
        to `"gpipe"`.
      recompute: keep only each stage's input and recompute its forward in
        the backward. Defaults to `False`.
      name: model name. Defaults to `"<model name>_pipelined"`.
      **kwargs: passed to `keras.Model`.

    Raises:
      ValueError: `micro_batches < 1`, an unknown schedule, or a plan that
        does not match the model.
    """
    micro_batches = _check_micro_batches(micro_batches)
    schedule = schedule_lib.check_schedule(schedule).value
    if not isinstance(recompute, bool):
      raise ValueError(f"recompute={recompute!r} must be True or False.")
    super().__init__(model, plan, name=name or f"{model.name}_pipelined",
                     **kwargs)
    self.micro_batches = micro_batches
    self.schedule = schedule
    self.recompute = recompute
    norms = [l.name for s in self.stages for l in s._flatten_layers()  # pylint: disable=protected-access
             if isinstance(l, keras.layers.BatchNormalization)]
    if norms and micro_batches > 1:
      logging.warning(
          "%s: BatchNormalization layers (%s) normalise each micro-batch of "
          "%d with its own statistics, so training differs from the unsplit "
          "model.", self.name, ", ".join(norms), micro_batches)

  @classmethod
  def from_model(cls, model: keras.Model,
                 plan: plan_lib.StagePlan | None = None, *,
                 num_stages: int | None = None, micro_batches: int = 4,
                 schedule: str = "gpipe", recompute: bool = False,
                 name: str | None = None, **plan_kwargs) -> "PipelinedModel":
    """Splits `model` along `plan` (or a new plan) and pipelines it.

    Args:
      model: the unsplit, built model.
      plan: a `StagePlan`; if `None`, one is made from `num_stages` and
        `plan_kwargs` (`criterion`, `split_points`, `devices`).
      num_stages: stages to plan when `plan` is `None`. Defaults to the
        number of accelerators.
      micro_batches, schedule, recompute: see `__init__`.
      name: model name.

    Returns:
      The `PipelinedModel`, holding a copy of `model`'s weights.
    """
    plan = staged.resolve_plan(model, plan, num_stages, plan_kwargs)
    return cls(model, plan, micro_batches=micro_batches, schedule=schedule,
               recompute=recompute, name=name)

  # ------------------------------------------------------------ helpers

  def _check_batch(self, x) -> list[Any]:
    """Raises (or, for an unknown batch size, asserts at run time) that
    `micro_batches` divides the batch; returns the run-time checks."""
    first = tf.nest.flatten(x)[0]
    size = first.shape[0] if hasattr(first, "shape") else None
    m = self.micro_batches
    rule = (f"is not divisible by micro_batches={m}. Use a batch size that "
            f"is a multiple of {m} (with fit, also drop or pad the last "
            "partial batch), or micro_batches that divides the batch.")
    if size is not None:
      if size % m:
        raise ValueError(f"The batch of {size} examples {rule} E.g. batch "
                         f"size {-(-size // m) * m}.")
      return []
    if m == 1:
      return []
    return [tf.debugging.assert_equal(
        tf.shape(first)[0] % m, 0,
        message=f"The batch (size in the next line) {rule}")]

  def _run_stage(self, k: int, inp, *, record: bool, training: bool,
                 scale=None, loss_term=None):
    """Runs stage `k` on one micro-batch; with `record`, under a tape.

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
          tape.watch(inp)
      out = stage(inp, training=training)
      objective = None
      if training:
        calls = _call_losses(stage)
        if calls:
          total = tf.add_n([tf.cast(tf.reduce_sum(l), tf.float32)
                            for l in calls])
          objective = scale(total) / float(self.micro_batches)
        if loss_term is not None:
          term = loss_term(out)
          objective = term if objective is None else term + objective
    return tape, out, objective

  def _forward_only(self, x, training: bool):
    """Streams micro-batches through the stages (no backward)."""
    K, M = len(self.stages), self.micro_batches
    with tf.device(self.stage_devices[0]), tf.name_scope("micro_batches"):
      xs = _split(x, M)
    outs, done = {}, [[] for _ in range(K)]
    orders = schedule_lib.stage_orders(K, M, self.schedule, forward_only=True)
    deps = lambda t: schedule_lib.dependencies(t, K, M, self.schedule)
    for task in schedule_lib.build_order(orders, deps):
      k, m = task.stage, task.micro_batch
      inp = xs[m] if k == 0 else outs[(k - 1, m)]
      with tf.device(self.stage_devices[k]), tf.name_scope(
          _FORWARD_SCOPE.format(k=k, m=m)), tf.control_dependencies(done[k]):
        outs[(k, m)] = self.stages[k](inp, training=training)
      done[k] = [outs[(k, m)]]
    with tf.device(self.stage_devices[-1]):
      return tf.concat([outs[(K - 1, m)] for m in range(M)], axis=0)

  # ------------------------------------------------------------- forward

  def call(self, inputs, training=None):
    """Streams `micro_batches` micro-batches through the stages.

    Outside training a batch that `micro_batches` does not divide is padded
    with zeros to the next multiple; the padding's outputs are dropped.
    """
    m = self.micro_batches
    if m == 1:
      return super().call(inputs, training=training)
    if training:
      with tf.control_dependencies(self._check_batch(inputs)):
        return self._forward_only(inputs, training=True)
    x = tf.convert_to_tensor(inputs)
    size = x.shape[0]
    if size is not None and size % m == 0:
      return self._forward_only(x, training=False)
    with tf.device(self.stage_devices[0]):
      n = tf.shape(x)[0]
      pad = (-n) % m
      x = tf.pad(x, [[0, pad]] + [[0, 0]] * (x.shape.rank - 1))
    out = self._forward_only(x, training=False)
    with tf.device(self.stage_devices[-1]):
      return out[:n]

  # ------------------------------------------------------------ training

  def compute_loss_and_gradients(self, x, y, loss_fn: placed.LossFn, *,
                                 scale_regularization=None,
                                 loss_reduction: str = "sum"):
    """One pipelined forward/backward over `micro_batches` micro-batches.

    This is the hook a custom training loop (tfmgpu's Trainer) calls;
    `train_step` (what `fit` runs) uses it too.

    Args:
      x: a batch of inputs; its size must be a multiple of `micro_batches`.
      y: its targets (any structure of tensors with the batch axis first).
      loss_fn: `loss_fn(y_true, y_pred)` returns the scalar loss to
        differentiate, averaged and scaled by the caller. It runs on the
        last stage's device: once on the whole batch (`"gpipe"`), or once
        per micro-batch (`"1f1b"`, see `loss_reduction`).
      scale_regularization: applied to each stage's regularisation losses,
        e.g. `optimizer.scale_loss`. Defaults to the identity.
      loss_reduction: for `"1f1b"` only, how per-micro-batch losses make
        the batch loss: `"sum"` when `loss_fn` divides by a fixed global
        batch size (tfmgpu's Trainer), `"mean"` when it averages over the
        rows it gets. Defaults to `"sum"`.

    Returns:
      `(loss, y_pred, grads)`: the differentiated objective (loss plus
      regularisation), the outputs of all micro-batches in order, and one
      gradient per variable of `self.trainable_variables`, summed over the
      micro-batches.

    Raises:
      ValueError: the batch size is not a multiple of `micro_batches`, or
        an unknown `loss_reduction`.
    """
    if loss_reduction not in LOSS_REDUCTIONS:
      raise ValueError(f"loss_reduction={loss_reduction!r} is unknown; use "
                       f"{' or '.join(map(repr, LOSS_REDUCTIONS))}.")
    scale = scale_regularization or (lambda t: t)
    K, M = len(self.stages), self.micro_batches
    last, gpipe = K - 1, self.schedule == schedule_lib.Schedule.GPIPE.value
    devices = self.stage_devices
    checks = self._check_batch(x)
    with tf.device(devices[0]), tf.name_scope("micro_batches"), \
        tf.control_dependencies(checks):
      xs = _split(x, M)
    ys = None
    if not gpipe:
      with tf.device(devices[last]), tf.name_scope("micro_targets"), \
          tf.control_dependencies(checks):
        ys = _split(y, M)
    factor = 1.0 / M if loss_reduction == "mean" else 1.0

    inputs, outs, tapes, objectives, upstream = {}, {}, {}, {}, {}
    grads = [collections.defaultdict(list) for _ in range(K)]
    done: list[list[Any]] = [[] for _ in range(K)]
    totals: list[Any] = []
    y_pred = None

    def loss_term(m):
      if gpipe:
        return None
      return lambda out: loss_fn(ys[m], out) * factor

    orders = schedule_lib.stage_orders(K, M, self.schedule)
    deps = lambda t: schedule_lib.dependencies(t, K, M, self.schedule)
    for task in schedule_lib.build_order(orders, deps):
      k, m = task.stage, task.micro_batch
      device = devices[k]
      if task.kind == FORWARD:
        inp = xs[m] if k == 0 else outs[(k - 1, m)]
        scope = _FORWARD_SCOPE.format(k=k, m=m)
        with tf.device(device), tf.name_scope(scope), \
            tf.control_dependencies(done[k]):
          tape, out, objective = self._run_stage(
              k, inp, record=not self.recompute, training=True, scale=scale,
              loss_term=loss_term(m) if k == last else None)
        inputs[(k, m)], outs[(k, m)] = inp, out
        tapes[(k, m)], objectives[(k, m)] = tape, objective
        done[k] = [out] + ([objective] if objective is not None else [])
        if objective is not None:
          totals.append(objective)
        continue

      if k == last and gpipe and y_pred is None:
        # The whole batch's loss, once, seeding every micro-batch's backward.
        with tf.device(device), tf.name_scope(f"stage_{k}_loss"):
          last_outs = [outs[(k, i)] for i in range(M)]
          with tf.GradientTape(watch_accessed_variables=False) as loss_tape:
            loss_tape.watch(last_outs)
            y_pred = tf.concat(last_outs, axis=0) if M > 1 else last_outs[0]
            loss = loss_fn(y, y_pred)
          seeds = loss_tape.gradient(loss, last_outs)
          for i, (o, s) in enumerate(zip(last_outs, seeds)):
            upstream[(k, i)] = tf.zeros_like(o) if s is None else s
        totals.append(loss)

      inp, grad_out = inputs.pop((k, m)), upstream.pop((k, m), None)
      tape, out, objective = tapes.pop((k, m)), outs[(k, m)], objectives.pop(
          (k, m))
      with tf.control_dependencies(done[k] + (
          [grad_out] if grad_out is not None else [])):
        if self.recompute:
          with tf.device(device), tf.name_scope(
              _RECOMPUTE_SCOPE.format(k=k, m=m)):
            tape, out, objective = self._run_stage(
                k, inp, record=True, training=True, scale=scale,
                loss_term=loss_term(m) if k == last else None)
        sources = [v.value for v in self.stages[k].trainable_variables]
        result = placed.backward_on_device(
            tape, device, _BACKWARD_SCOPE.format(k=k, m=m),
            outputs=[out] if grad_out is not None else [],
            output_gradients=[grad_out] if grad_out is not None else [],
            objective=objective, sources=sources + ([inp] if k > 0 else []))
      del tape
      if k > 0:
        grad_in = result.pop()
        if grad_in is None:  # The stage ignores its input.
          with tf.device(device):
            grad_in = tf.zeros_like(inp)
        upstream[(k - 1, m)] = grad_in
      for i, g in enumerate(result):
        grads[k][i].append(g)
      signals = [getattr(g, "values", g) for g in result if g is not None]
      done[k] = signals + ([upstream[(k - 1, m)]] if k > 0 else []) or done[k]

    if y_pred is None:
      with tf.device(devices[last]):
        y_pred = tf.concat([outs[(last, i)] for i in range(M)], axis=0)
    summed = self._accumulate(grads, totals, scale)
    with tf.device(devices[last]):
      total = tf.add_n([tf.cast(t, tf.float32) for t in totals])
    return total, y_pred, [summed.get(id(v)) for v in self.trainable_variables]

  def _accumulate(self, grads, totals, scale) -> dict[int, Any]:
    """Sums each variable's micro-batch gradients on its stage's device and
    adds the weight regularisation (once per step)."""
    out = {}
    for k, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
      variables = stage.trainable_variables
      with tf.device(device), tf.name_scope(f"stage_{k}_accumulate"):
        summed = [_sum_gradients(grads[k][i]) for i in range(len(variables))]
      sources = [v.value for v in variables]
      with tf.device(device), tf.name_scope(f"stage_{k}_regularization"):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
          tape.watch(sources)
          terms = _weight_regularization(stage)
          reg = (scale(tf.add_n([tf.cast(t, tf.float32) for t in terms]))
                 if terms else None)
      if reg is not None:
        totals.append(reg)
        reg_grads = placed.backward_on_device(
            tape, device, f"stage_{k}_backward_regularization", outputs=[],
            output_gradients=[], objective=reg, sources=sources)
        with tf.device(device), tf.name_scope(f"stage_{k}_accumulate"):
          summed = [_sum_gradients([g, r]) for g, r in zip(summed, reg_grads)]
      out.update({id(v): g for v, g in zip(variables, summed)})
    return out

  def _fit_loss_options(self) -> dict[str, Any]:
    """How `fit`'s compiled loss combines over micro-batches (for 1F1B)."""
    if self.schedule == schedule_lib.Schedule.GPIPE.value:
      return {}
    reduction = getattr(self.loss, "reduction", "sum_over_batch_size")
    if reduction in ("sum_over_batch_size", "mean"):
      return {"loss_reduction": "mean"}
    if reduction == "sum":
      return {"loss_reduction": "sum"}
    raise ValueError(
        f"schedule='1f1b' computes the loss per micro-batch, which cannot "
        f"reproduce a loss with reduction={reduction!r}. Use reduction="
        "'sum_over_batch_size' or 'sum', or schedule='gpipe' (which computes "
        "the loss once on the whole batch).")
