"""Pipeline parallelism: micro-batches streamed through device-placed stages.

`PipelinedModel` is a `StagedModel` whose training step splits the batch into
`M` micro-batches (equal ones when `M` divides it; a short last batch of
`n >= M` rows into `n % M` parts one row longer than the rest, each
weighted by its rows wherever a loss is averaged per part, so a step on it
equals the unsplit step too). Stage `k`'s forward `F(k, m)` and backward `B(k, m)` run
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

Interleaved 1F1B: with `virtual_stages=V`, a plan of `K * V` stages whose
devices repeat every `K` (stage `k` on the device of stage `k % K`; what
`from_model(num_stages=K, virtual_stages=V)` makes) runs each device's
non-consecutive stages in `schedule.device_orders`'s order: the bubble
shrinks by `V` (`timeline.simulate(..., virtual_stages=V)` predicts it), at
the price of `V` times more sends between devices.

Regularisation: weight regularisers are counted once per step (their own
small backward per stage); losses added during a call (activity
regularisers, which Keras divides by the batch size, and `add_loss`) are
averaged over the micro-batches, each weighted by its share of the rows.

`recompute=True` keeps only each stage's input per micro-batch: the forward
runs without a tape, and the backward re-runs the stage forward under its
device (after its upstream gradient has arrived, so the executor cannot hoist
it into the forward phase) and differentiates that.
`tfmgpu.benchmarks.pipeline.saved_activation_bytes` reads from the traced
graph what each stage keeps for its backward (it finds a stage's backward ops
with `backward_stage`).

The training step's ops are built by `tfmgpu.parallel.pipeline_step`; the
micro-batch helpers (split, sum of gradients, losses) are in
`tfmgpu.parallel.microbatch`.

Known differences from unsplit training: BatchNormalization sees micro-batch
statistics (and updates its moving averages once per micro-batch; twice with
recompute), and random layers such as Dropout draw new randomness when a
stage is recomputed. An output that carries a Keras mask (after
`Embedding(mask_zero=True)`) keeps it for the loss under `"gpipe"`; `"1f1b"`
refuses it with a loss averaged per micro-batch (each would be averaged over
its own unmasked entries).

Inference (`call`, `predict`, `evaluate`) streams the micro-batches through
the stages the same way and concatenates the outputs in order. A batch that
`micro_batches` does not divide is zero-padded to the next multiple and the
padding's outputs are dropped (training splits it unevenly instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import pipeline_step
from tfmgpu.parallel import placed
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import schedule as schedule_lib
from tfmgpu.parallel import staged


def backward_stage(op_name: str) -> int | None:
  """The stage whose backward an op of a traced pipelined step belongs to.

  Reads the name scopes `PipelinedModel` gives its ops
  (`pipeline_step.BACKWARD_OP`): a stage's gradient ops and, with
  recomputation, its recomputed forward. `None` for any other op.
  """
  match = pipeline_step.BACKWARD_OP.match(op_name)
  if not match:
    return None
  return int(match.group(1) or match.group(2))


class PipelinedModel(staged.StagedModel):
  """A `StagedModel` that pipelines micro-batches through its stages.

  Example:

    model = tfmgpu.models.demo.deep_mlp((784,), 10)
    pipe = tfmgpu.parallel.PipelinedModel.from_model(
        model, num_stages=4, micro_batches=8, schedule="1f1b")
    pipe.compile(optimizer="adam", loss=...)
    pipe.fit(x, y, batch_size=256)      # 8 micro-batches of 32

  Attributes:
    micro_batches: micro-batches per step (`M`).
    schedule: `"gpipe"` or `"1f1b"`.
    recompute: re-run each stage's forward in its backward instead of
      keeping its activations.
  """

  places_itself = True

  def __init__(self, model: keras.Model, plan: plan_lib.StagePlan, *,
               micro_batches: int = 4, schedule: str = "gpipe",
               recompute: bool = False, virtual_stages: int = 1,
               name: str | None = None, **kwargs):
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
      virtual_stages: `V` stages per device, interleaved 1F1B (`"1f1b"`,
        `micro_batches` a multiple of the devices): the plan's `K * V`
        stages must repeat its first `K` devices in order. Defaults to `1`.
      name: model name. Defaults to `"<model name>_pipelined"`.
      **kwargs: passed to `keras.Model`.

    Raises:
      ValueError: `micro_batches < 1`, an unknown schedule, a plan that
        does not match the model, or one that cannot interleave
        `virtual_stages`.
    """
    micro_batches = microbatch.check_micro_batches(micro_batches)
    schedule = schedule_lib.check_schedule(schedule).value
    if not isinstance(recompute, bool):
      raise ValueError(f"recompute={recompute!r} must be True or False.")
    super().__init__(model, plan, name=name or f"{model.name}_pipelined",
                     **kwargs)
    self.micro_batches = micro_batches
    self.schedule = schedule
    self.recompute = recompute
    self.virtual_stages = _check_virtual(self.stage_devices, virtual_stages,
                                         micro_batches, schedule)
    _warn_per_micro_batch(self.name, self.stages, micro_batches, recompute)

  @classmethod
  def from_model(cls, model: keras.Model,
                 plan: plan_lib.StagePlan | None = None, *,
                 num_stages: int | None = None, micro_batches: int = 4,
                 schedule: str = "gpipe", recompute: bool = False,
                 virtual_stages: int = 1, name: str | None = None,
                 **plan_kwargs) -> "PipelinedModel":
    """Splits `model` along `plan` (or a new plan) and pipelines it.

    Args:
      model: the unsplit, built model.
      plan: a `StagePlan`; if `None`, one is made from `num_stages` and
        `plan_kwargs` (`criterion`, `split_points`, `devices`).
      num_stages: stages to plan when `plan` is `None`. Defaults to the
        number of accelerators. With `virtual_stages=V`, the devices `K`:
        the plan then has `K * V` stages, stage `k` on device `k % K`.
      micro_batches, schedule, recompute, virtual_stages: see `__init__`.
      name: model name.

    Returns:
      The `PipelinedModel`, holding a copy of `model`'s weights.
    """
    if plan is None and virtual_stages != 1:
      devices = list(plan_kwargs.pop("devices", None)
                     or devices_lib.accelerator_devices()[:num_stages])
      num_stages = len(devices) * virtual_stages
      plan_kwargs["devices"] = [devices[k % len(devices)]
                                for k in range(num_stages)]
    plan = staged.resolve_plan(model, plan, num_stages, plan_kwargs)
    return cls(model, plan, micro_batches=micro_batches, schedule=schedule,
               recompute=recompute, virtual_stages=virtual_stages, name=name)

  # ------------------------------------------------------------ helpers

  def _check_batch(self, x) -> list[Any]:
    """Raises (or, for an unknown batch size, asserts at run time) that the
    batch has at least `micro_batches` rows (it splits into near-equal
    parts); returns the run-time checks."""
    m = self.micro_batches
    return microbatch.check_rows(x, m, (
        f"has fewer rows than micro_batches={m}, so some micro-batches "
        f"would be empty. Use batches of at least {m} rows (with a "
        "dataset's short last batch: drop_remainder=True), or fewer "
        "micro_batches."))

  def _forward_only(self, x, training: bool):
    """Streams micro-batches through the stages (no backward)."""
    K, M = len(self.stages), self.micro_batches
    with tf.device(self.stage_devices[0]), tf.name_scope("micro_batches"):
      xs = microbatch.split(x, M, uneven=training)
    outs, done = {}, [[] for _ in range(K)]
    orders = schedule_lib.stage_orders(K, M, self.schedule, forward_only=True)
    deps = lambda t: schedule_lib.dependencies(t, K, M, self.schedule)
    for task in schedule_lib.build_order(orders, deps):
      k, m = task.stage, task.micro_batch
      inp = xs[m] if k == 0 else outs[(k - 1, m)]
      scope = pipeline_step.FORWARD_SCOPE.format(k=k, m=m)
      with tf.device(self.stage_devices[k]), tf.name_scope(scope), \
          tf.control_dependencies(done[k]):
        outs[(k, m)] = self.stages[k](inp, training=training)
      done[k] = tf.nest.flatten(outs[(k, m)])
    with tf.device(self.stage_devices[-1]):
      return microbatch.concat([outs[(K - 1, m)] for m in range(M)])

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
    x = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    first = tf.nest.flatten(x)[0]
    size = first.shape[0]
    if size is not None and size % m == 0:
      return self._forward_only(x, training=False)
    with tf.device(self.stage_devices[0]):
      n = tf.shape(first)[0]
      pad = (-n) % m
      x = tf.nest.map_structure(
          lambda t: tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)), x)
    out = self._forward_only(x, training=False)
    with tf.device(self.stage_devices[-1]):
      return microbatch.head(out, n)

  # ------------------------------------------------------------ training

  def compute_loss_and_gradients(self, x, y, loss_fn: placed.LossFn, *,
                                 scale_regularization=None,
                                 loss_reduction: str = "sum"):
    """One pipelined forward/backward over `micro_batches` micro-batches.

    This is the hook a custom training loop (tfmgpu's Trainer) calls;
    `train_step` (what `fit` runs) uses it too.

    Args:
      x: a batch of inputs, as the unsplit model takes them (a tensor, or a
        list or dict of them) of at least `micro_batches` rows (split
        into near-equal parts). Inputs that later stages read travel with
        the activations.
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
        rows it gets (each micro-batch then weighted by its rows).
        Defaults to `"sum"`.

    Returns:
      `(loss, y_pred, grads)`: the differentiated objective (loss plus
      regularisation), the outputs of all micro-batches in order, and one
      gradient per variable of `self.trainable_variables`, summed over the
      micro-batches.

    Raises:
      ValueError: a batch of fewer rows than `micro_batches`, or an
        unknown `loss_reduction`.
    """
    step = pipeline_step.PipelineStep(
        self.stages, self.stage_devices, micro_batches=self.micro_batches,
        schedule=self.schedule, recompute=self.recompute, loss_fn=loss_fn,
        scale=scale_regularization or (lambda t: t),
        loss_reduction=loss_reduction, virtual_stages=self.virtual_stages)
    loss, y_pred, summed = step.run(x, y, self._check_batch(x))
    return loss, y_pred, [summed.get(id(v)) for v in self.trainable_variables]

  def loss_parts(self) -> str | None:
    """1F1B averages `fit`'s loss over micro-batches; GPipe takes one."""
    if (self.schedule == schedule_lib.Schedule.GPIPE.value
        or self.micro_batches == 1):
      return None
    return (f"schedule='1f1b' averages the losses of its "
            f"{self.micro_batches} micro-batches")

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


def _warn_per_micro_batch(name: str, stages: Sequence[keras.Model],
                          micro_batches: int, recompute: bool) -> None:
  """Says what micro-batches and recomputation change: a training
  BatchNormalization normalises each micro-batch by its own statistics; a
  user's layer with non-trainable state (a running mean it may assign in
  `call`) updates it once per micro-batch, and again when recomputed; with
  recomputation, dropout draws other masks for the backward."""
  layers = [l for s in stages for l in _compat.flatten_layers(s)]
  norms = checks.training_norms(stages)
  if norms and micro_batches > 1:
    logging.warning(
        "%s: BatchNormalization layers (%s) normalise each of the %d "
        "micro-batches with its own statistics (of its rows alone), and "
        "update their moving statistics once per micro-batch run (%d times "
        "a step), so training differs from the unsplit model's; "
        "micro_batches=1 normalises the whole batch.", name,
        ", ".join(norms), micro_batches, micro_batches * (1 + recompute))
  if micro_batches > 1:
    checks.say_random_draws(name, stages, f"for each of the {micro_batches} "
                            "micro-batches")
  stateful = [l.name for l in layers if l.trainable and l.non_trainable_weights
              and checks.users_class(l)
              and not getattr(l, "lora_enabled", False)]
  if stateful and (micro_batches > 1 or recompute):
    logging.warning(
        "%s: layers %s hold non-trainable state; an update their call() makes "
        "(a running mean or count) runs once per micro-batch%s, so it differs "
        "from the unsplit model's (if it is updated in call). For the "
        "unsplit model's updates, split it without micro-batches "
        "(--strategy=model_parallel, or micro_batches=1 without "
        "recompute).", name, ", ".join(stateful),
        " and again when recomputed" if recompute else "")
  noisy = [l.name for l in layers if recompute and isinstance(
      l, (keras.layers.Dropout, keras.layers.GaussianNoise,
          keras.layers.GaussianDropout)) and getattr(
              l, "rate", getattr(l, "stddev", 0))]
  if noisy:
    logging.warning(
        "%s: with recompute=True the backward re-runs %s and draws other "
        "random masks than the forward that gave the loss; train with "
        "recompute=False for gradients of the forward's own masks.", name,
        ", ".join(noisy))


def _check_virtual(devices: Sequence[str], virtual_stages: int,
                   micro_batches: int, schedule: str) -> int:
  """`virtual_stages`, checked against the stages' devices.

  Raises:
    ValueError: see `schedule.check_interleaved`, or stages whose devices
      do not repeat the first `len(devices) / virtual_stages` in order.
  """
  k = len(devices) // schedule_lib.check_virtual_stages(virtual_stages)
  if len(devices) % virtual_stages or any(
      devices[i] != devices[i % k] for i in range(len(devices))):
    raise ValueError(
        f"virtual_stages={virtual_stages} needs a plan whose stages repeat "
        f"its first devices in order (stage k on the device of stage k % K); "
        f"got {len(devices)} stages on {list(devices)}. Make it with "
        f"PipelinedModel.from_model(model, num_stages=K, virtual_stages="
        f"{virtual_stages}).")
  schedule_lib.check_interleaved(k, virtual_stages, micro_batches, schedule)
  return virtual_stages
