"""The trainer: a Keras model, its optimizer and strategy, and `fit`.

The outermost of the three layers, as an object a user holds. `Trainer`
owns the optimizer (built in the strategy's scope before the first step,
which Keras 3 needs inside a distributed `tf.function`), compiles the step
(`tfmgpu.training.step`) into a distributed function
(`tfmgpu.training.distributed`), wraps it in a runner
(`tfmgpu.training.runners`) and hands it to the `Controller`
(`tfmgpu.training.controller`), which runs the epochs.
"""

from __future__ import annotations

import contextlib
import warnings
import os
from typing import Any, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import rundir
from tfmgpu import strategies as strategies_lib
from tfmgpu.training import allreduce as allreduce_lib
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import distributed
from tfmgpu.training import feeds
from tfmgpu.training import inputs
from tfmgpu.training import objectives
from tfmgpu.training import preemption as preemption_lib
from tfmgpu.training import resident
from tfmgpu.training import runners
from tfmgpu.training import step as step_lib
from tfmgpu.training.controller import Controller
from tfmgpu.training.controller import LoopOptions
from tfmgpu.training.controller import NonFiniteLossError  # pylint: disable=unused-import  (public here)
from tfmgpu.training.controller import TrainResult
from tfmgpu.training.optimizers import prepare_optimizer
from tfmgpu.training.optimizers import OPTIMIZER_CHOICES  # pylint: disable=unused-import  (public here)


def _check_built_in_scope(model: keras.Model,
                          strategy: tf.distribute.Strategy) -> None:
  if not model.trainable_variables:
    raise ValueError(
        f"model {model.name!r} has no trainable variables: build it before "
        "training. Give it a keras.Input, or call it once on a batch inside "
        "the strategy's scope (`with strategy.scope(): model(x[:1])`; "
        "`model.build(shape)` does not create the variables of a subclassed "
        "model without a build() method).")
  if (strategy.num_replicas_in_sync == 1
      and not strategies_lib.in_multi_worker_mode(strategy)):
    return
  v = model.trainable_variables[0]
  if not strategy.extended.variable_created_in_scope(getattr(v, "value", v)):
    raise ValueError(
        f"model {model.name!r} was not built in the scope of the strategy "
        f"({type(strategy).__name__}, {strategy.num_replicas_in_sync} "
        "replicas): its variables would not be mirrored. Build it under "
        "`with strategy.scope():` (tfmgpu.build_model does this for you).")


def _warn_about_custom_steps(model: keras.Model) -> None:
  """Logs a warning when the model overrides a step the Trainer never
  calls (`train_step`, `test_step`, `compute_loss`)."""
  if hasattr(model, "compute_loss_and_gradients"):
    return  # A placed model: the Trainer runs its per-device backward.
  custom = [name for name in ("train_step", "test_step", "compute_loss")
            if getattr(type(model), name, None) is not getattr(keras.Model,
                                                               name)]
  if custom:
    logging.warning(
        "Model %r overrides %s: tfmgpu's Trainer runs its own step (forward, "
        "Trainer(loss=...), gradients, all-reduce, update) and does not call "
        "it. Put extra loss terms in call() with self.add_loss(...), or train "
        "with model.fit under strategy.scope() to use your own step.",
        model.name, ", ".join(custom))


def steps_in_one_pass(num_examples: int, *, epochs: int,
                      global_batch_size: int) -> int:
  """Full global batches in one pass over the data; checks `epochs` too.

  Raises:
    ValueError: `epochs < 1`, or fewer examples than one global batch.
  """
  if epochs < 1:
    raise ValueError(f"epochs={epochs} must be >= 1.")
  full = num_examples // global_batch_size
  if full < 1:
    raise ValueError(f"global_batch_size={global_batch_size} is larger than "
                     f"the {num_examples} training examples; use a smaller "
                     "batch.")
  return full


DEFAULT_GLOBAL_BATCH = 64
# TF warns about its own `options()` call when a `tf.function` iterates a
# distributed dataset; nothing for the user to do.
_TF_DATA_OPTIONS_WARNING = "To make it possible to preserve tf.data options"


def _dataset_steps(source: inputs.InputData, strategy: tf.distribute.Strategy,
                   steps_per_epoch: int | None) -> int | None:
  """Batches in one pass of a user's dataset (`None`: endless, then
  `steps_per_epoch` is required)."""
  card = (source.cardinality if isinstance(source, inputs.DatasetData)
          else source.cardinality(strategy))
  if card == 0:
    raise ValueError("x is an empty dataset (0 batches); check its source "
                     "and its batch(..., drop_remainder=...).")
  if card in (None, inputs.INFINITE):
    if steps_per_epoch is None:
      what = "infinite" if card == inputs.INFINITE else "of unknown length"
      raise ValueError(
          f"x is a dataset {what}: pass steps_per_epoch=N (or, for a finite "
          "one, tell TF its length with "
          "dataset.apply(tf.data.experimental.assert_cardinality(n))).")
    return None
  return card


def _describe_input(source: inputs.InputData, feed: str,
                    refusal: str | None = None) -> str:
  """The log line's words for where batches come from."""
  if feed == feeds.DEVICE:
    return "in-memory arrays on each replica's device"
  if feed == feeds.HOST_SPLIT:
    return ("the given tf.data.Dataset, read once on the host; each global "
            "batch is split over the replicas in the step")
  if isinstance(source, inputs.DatasetData):
    return ("the given tf.data.Dataset, its global batches split over the "
            f"replicas by TF's distributed iterator ({refusal})")
  return {inputs.ArrayData: "in-memory arrays through a tf.data pipeline",
          inputs.DatasetFnData: "the given dataset function (one pipeline "
                                "per worker)"}[type(source)]


class Trainer:
  """Trains a Keras model with `strategy.run` steps, on any strategy.

  Example:
    strategy = tfmgpu.get_strategy("mirrored")
    with strategy.scope():
      model = tfmgpu.build_model("convnet", input_shape=(28, 28, 1),
                                 num_classes=10)
    trainer = tfmgpu.Trainer(model, strategy=strategy, learning_rate=1e-3)
    result = trainer.fit(x, y, epochs=2, global_batch_size=64)

  Args:
    model: a Keras model built in `strategy.scope()`; a staged or pipelined
      model brings its own per-device backward.
    strategy: the `tf.distribute.Strategy`; defaults to the current one.
    optimizer: a name (see `OPTIMIZER_CHOICES`) or a Keras optimizer.
      Defaults to `"adam"`. Float16 models get a `LossScaleOptimizer`.
    learning_rate: used with an optimizer name. Defaults to `1e-3`.
    clip_norm: clip the all-reduced gradient to this global norm (Keras
      would clip each replica's partial gradient). Defaults to `None`.
    gradient_compression: `"none"`, `"float16"` or `"bfloat16"`: the dtype
      gradients are all-reduced in (half the bytes). Defaults to `"none"`.
    bytes_per_pack: all-reduce pack size in bytes (0: TF's default).
    loss: a Keras loss: a name, a `keras.losses.Loss`, a function
      `fn(y_true, y_pred)`, or a dict (by output name) or list of them for a
      model with several outputs. Defaults to sparse categorical
      cross-entropy from logits. See `tfmgpu.training.objectives`.
    metrics: Keras metrics (names or `keras.metrics.Metric` objects), a list
      for every output or a dict by output name. Defaults to
      `["accuracy"]` with the default loss, none otherwise. Reduced from
      summed states, exact across replicas, micro-batches and workers. As
      in Keras, they ignore `sample_weight`.
    loss_weights: per-output weights of the total loss (dict or list).
    weighted_metrics: metrics weighted by `sample_weight`, given as
      `metrics` (Keras' `compile(weighted_metrics=...)`); one named like an
      unweighted metric is reported as `weighted_<name>`.
    steps_per_execution: steps run per `tf.function` call. Defaults to `1`.
    jit_compile: XLA-compile each replica's forward/backward.
    fused_optimizer: when `optimizer` is a name, update each variable with
      one fused kernel (`tfmgpu.training.fused`); an optimizer object is
      used as given.
    input_mode: `"device"` copies the training arrays to every replica's
      device once and gathers each batch there (`tfmgpu.training.resident`);
      `"tf_data"` reads them through a `tf.data` pipeline; `"auto"` (the
      default) picks `"device"` on one host when all replicas' copies take
      at most `resident.DEFAULT_MAX_BYTES`. Both give each replica the same
      examples. For a `tf.data.Dataset`, `"auto"` reads it with one host
      iterator and splits each batch in the step where the replicas are
      CPUs (`tfmgpu.training.feeds`); `"tf_data"` keeps TF's distributed
      iterator.
    model_dir: where checkpoints and TensorBoard summaries go; `None` keeps
      nothing. A directory with checkpoints is resumed from. While `fit`
      runs, the chief holds the directory's lock (`tfmgpu.rundir`): a second
      run on it refuses.
    checkpoint_every_steps: also save a checkpoint every N global steps (at
      the first call boundary reaching a multiple of N), not only per epoch.
    checkpoint_every_s: also save a checkpoint once N seconds have passed
      since the last save (agreed by every worker).
    callbacks: Keras callbacks (epoch/batch hooks, `model.stop_training`).
    verbose: 1 shows a progress line per epoch (plain off a terminal), 0
      logs one line per epoch.
  """

  def __init__(self, model: keras.Model, *,
               strategy: tf.distribute.Strategy | None = None,
               optimizer: str | keras.optimizers.Optimizer = "adam",
               learning_rate: float = 1e-3, clip_norm: float | None = None,
               gradient_compression: str = "none", bytes_per_pack: int = 0,
               loss: Any = None, metrics: Any = None,
               loss_weights: Any = None, weighted_metrics: Any = None,
               steps_per_execution: int = 1,
               jit_compile: bool = False, fused_optimizer: bool = True,
               input_mode: str = "auto", model_dir: str | None = None,
               checkpoint_every_steps: int | None = None,
               checkpoint_every_s: float | None = None,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               verbose: int = 1):
    if steps_per_execution < 1:
      raise ValueError(f"steps_per_execution={steps_per_execution} must be >= 1.")
    self.model = model
    self.strategy = strategy or tf.distribute.get_strategy()
    self.objective = objectives.Objective(model, loss, metrics, loss_weights,
                                          weighted_metrics)
    self.steps_per_execution = steps_per_execution
    resident.check_input_mode(input_mode, self.strategy)
    self.input_mode = input_mode
    self.jit_compile = jit_compile
    self.model_dir = model_dir
    self.checkpoint_every = (checkpoint_every_steps, checkpoint_every_s)
    self.verbose = verbose
    _check_built_in_scope(model, self.strategy)
    _warn_about_custom_steps(model)
    # tfmgpu sums replica gradients itself (then clips), except under
    # parameter servers, where gradients go to the variables' servers.
    owns_allreduce = not isinstance(
        self.strategy, tf.distribute.experimental.ParameterServerStrategy)
    self.allreduce = allreduce_lib.AllReduceOptions(
        compression=gradient_compression, bytes_per_pack=bytes_per_pack,
        clip_norm=clip_norm) if owns_allreduce else None
    self.optimizer = prepare_optimizer(
        optimizer, model, self.strategy, learning_rate=learning_rate,
        clip_norm=None if owns_allreduce else clip_norm, fused=fused_optimizer)
    if owns_allreduce:
      allreduce_lib.take_over_aggregation(self.optimizer)
    self.callbacks = list(callbacks)
    self._train_fns: dict[tuple[int | None, str], Any] = {}
    self._eval_fns: dict[bool, Any] = {}
    self._resident_eval_fn = None
    self._eval_held: tuple | None = None
    self._checkpointer: ckpt_lib.Checkpointer | None = None
    self._writer = None

  # ------------------------------------------------------------ helpers

  @property
  def num_replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

  @property
  def checkpointer(self) -> ckpt_lib.Checkpointer | None:
    """The run's checkpoints (`None` without a `model_dir`)."""
    if self.model_dir and self._checkpointer is None:
      self._checkpointer = ckpt_lib.Checkpointer(
          self.model_dir, self.strategy, model=self.model,
          optimizer=self.optimizer)
    return self._checkpointer

  def _train_fn(self, global_batch_size: int | None,
                feed: str = feeds.ITERATOR):
    key = (global_batch_size, feed)
    if key not in self._train_fns:
      step = step_lib.make_train_step(
          self.model, self.optimizer, global_batch_size=global_batch_size,
          loss=self.objective, jit_compile=self.jit_compile,
          allreduce=self.allreduce)
      self._train_fns[key] = self._make_train_function(step, feed)
    return self._train_fns[key]

  def _make_train_function(self, step, feed: str):
    """The distributed function that runs `step` several times per call."""
    return distributed.make_train_function(
        self.strategy, step,
        check_fn=lambda: step_lib.non_finite_weights(self.model),
        feed=feed,
        metric_shapes=self.objective.state_shapes())

  def _summaries(self) -> tuple[Any, bool]:
    """The summary writer (a no-op one off the chief) and whether it writes."""
    writes = bool(self.model_dir) and ckpt_lib.is_chief(self.strategy)
    if self._writer is None:
      self._writer = (tf.summary.create_file_writer(
          os.path.join(self.model_dir, "summaries")) if writes
                      else tf.summary.create_noop_writer())
    return self._writer, writes

  def _loop_options(self, global_batch_size: int | None, validation_data
                    ) -> LoopOptions:
    writer, writes = self._summaries()
    validate = None
    if validation_data is not None:
      val_source = inputs.from_validation_data(validation_data)

      def validate_once() -> dict[str, float]:
        val = self._evaluate(val_source, global_batch_size or 256, keep=True)
        return {f"val_{k}": v for k, v in val.items() if k != "count"}

      validate = validate_once

    return LoopOptions(
        model=self.model, optimizer=self.optimizer,
        global_batch_size=global_batch_size, callbacks=self.callbacks,
        verbose=self.verbose, checkpointer=self.checkpointer,
        summary_writer=writer, writes_summaries=writes, validate=validate,
        metric_results=self.objective.results,
        metric_names=self.objective.metric_names,
        checkpoint_every_steps=self.checkpoint_every[0],
        checkpoint_every_s=self.checkpoint_every[1])

  def _hold_run_dir(self):
    """The run directory's lock while `fit` runs (the chief's; see
    `tfmgpu.rundir`). Reentrant: the train CLI holds it already."""
    if not self.model_dir or not ckpt_lib.is_chief(self.strategy):
      return contextlib.nullcontext()
    return rundir.RunLock(self.model_dir)

  @contextlib.contextmanager
  def _optimizer_on_model(self):
    """`model.optimizer` is the Trainer's while `fit` runs, as in Keras
    `fit`: callbacks read and set it (`ReduceLROnPlateau`,
    `LearningRateScheduler`). Restored after: the Trainer's optimizer does
    not all-reduce by itself (`allreduce.take_over_aggregation`), so a later
    `model.fit` must not pick it up."""
    missing = object()
    before = getattr(self.model, "optimizer", missing)
    self.model.optimizer = self.optimizer
    try:
      yield
    finally:
      if before is missing:
        del self.model.optimizer
      else:
        self.model.optimizer = before

  def _watch_preemption(self):
    """SIGTERM becomes a checkpoint when the run keeps checkpoints."""
    if not self.model_dir:
      return contextlib.nullcontext()
    return preemption_lib.PreemptionWatcher(self.strategy)

  # --------------------------------------------------------------- API

  def evaluate(self, x: Any, y: Any = None, *, sample_weight: Any = None,
               global_batch_size: int = 256) -> dict[str, float]:
    """The loss and metrics over every example of the input (no row dropped).

    Args:
      x, y, sample_weight: as for `fit` (arrays, a dataset or a dataset
        function); arrays are batched by `global_batch_size`, their last
        batch padded and masked out.
      global_batch_size: examples per evaluation step over all replicas.

    Returns:
      `{"loss": mean loss, <metric>: value, ..., "count": rows}`.
    """
    return self._evaluate(inputs.from_user(x, y, sample_weight),
                          global_batch_size)

  def _evaluate(self, source: inputs.InputData, global_batch_size: int,
                keep: bool = False) -> dict[str, float]:
    """`evaluate` of an `InputData`; `keep` holds arrays on the devices for
    the next call (validation data during `fit`)."""
    if (isinstance(source, inputs.DatasetData)
        and source.cardinality == inputs.INFINITE):
      raise ValueError("The dataset to evaluate is infinite (it repeats): "
                       "evaluation reads every batch once. Give it without "
                       ".repeat() (validation_data likewise).")
    held = self._held_for_evaluation(source, global_batch_size, keep)
    if held is not None:
      out = self._resident_eval_fn(*held)
    else:
      split = (isinstance(source, inputs.DatasetData)
               and self._split_refusal(source) is None)
      if split not in self._eval_fns:
        self._eval_fns[split] = self._make_eval_fn(split)
      with warnings.catch_warnings():  # TF's own, from tracing the loop.
        warnings.filterwarnings("ignore", message=_TF_DATA_OPTIONS_WARNING)
        out = self._eval_fns[split](
            self._eval_dataset(source, global_batch_size, split))
    sums = {k: v.numpy() for k, v in out.items()}
    n = max(float(sums["count"]), 1.0)
    result = {"loss": float(sums["loss_sum"]) / n}
    result.update(self.objective.results(sums))
    result["count"] = float(sums["count"])
    return result

  def _held_for_evaluation(self, source: inputs.InputData,
                           global_batch_size: int, keep: bool
                           ) -> tuple | None:
    """`(batches, num_steps)` of arrays held on the devices, or `None` to
    read through `tf.data` (`input_mode` decides, as in training; under
    `auto` evaluation data gets half the byte budget, the other half being
    the training copy's). With `keep`, the copy (or the decision not to
    make one) is kept for the next call with the same arrays."""
    if (not isinstance(source, inputs.ArrayData)
        or not resident.supports(self.strategy)):
      return None
    key = (tuple(id(a) for a in tf.nest.flatten(source.data)),
           global_batch_size)
    if self._eval_held is None or self._eval_held[0] != key:
      data_lib.check_global_batch(global_batch_size, self.num_replicas)
      if not resident.use_device_data(
          self.input_mode, self.strategy, source.data,
          max_bytes=resident.DEFAULT_MAX_BYTES // 2):
        if keep:
          self._eval_held = (key, source, None, None)
        return None
      held = resident.DeviceData(self.strategy,
                                 source.padded(global_batch_size))
      steps = held.num_examples // global_batch_size
      batches = held.epoch(global_batch_size=global_batch_size, steps=steps,
                           seed=0, epoch=0, shuffle=False).from_step(0)
      if self._resident_eval_fn is None:
        self._resident_eval_fn = distributed.make_resident_eval_function(
            self.strategy,
            step_lib.make_eval_step(self.model, loss=self.objective),
            metric_shapes=self.objective.state_shapes())
      if not keep:
        return batches, tf.constant(steps)
      # The source is kept so that the ids in the key stay its arrays'.
      self._eval_held = (key, source, batches, steps)
    _, _, batches, steps = self._eval_held
    return None if batches is None else (batches, tf.constant(steps))

  def _make_eval_fn(self, split_on_host: bool = False):
    return distributed.make_eval_function(
        self.strategy, step_lib.make_eval_step(self.model, loss=self.objective),
        split_on_host=split_on_host,
        metric_shapes=self.objective.state_shapes())

  def _eval_dataset(self, source: inputs.InputData, global_batch_size: int,
                    split_on_host: bool = False):
    """Every row once: arrays' last batch padded and masked out; a user's
    dataset as it comes, with a mask of ones (split over the replicas by
    the step with `split_on_host`, else by TF)."""
    if isinstance(source, inputs.DatasetData):
      masked = inputs.with_mask(source.dataset)
      return (masked if split_on_host
              else self.strategy.experimental_distribute_dataset(masked))
    if isinstance(source, inputs.DatasetFnData):
      return self.strategy.distribute_datasets_from_function(
          lambda ctx: inputs.with_mask(source.fn(ctx)))
    data_lib.check_global_batch(global_batch_size, self.num_replicas)
    return inputs.distribute_arrays(
        self.strategy, source.padded(global_batch_size),
        global_batch_size=global_batch_size)

  def fit(self, x: Any, y: Any = None, *, sample_weight: Any = None,
          epochs: int = 1, global_batch_size: int | None = None,
          steps_per_epoch: int | None = None, validation_data: Any = None,
          seed: int = 0, shuffle: bool = True) -> TrainResult:
    """Trains for `epochs` (resuming from `model_dir` if it has checkpoints).

    Inputs follow Keras (`tfmgpu.training.inputs`): in-memory arrays (any
    nesting of dicts, lists and tuples), batched here; a `tf.data.Dataset`
    of `(x, y[, sample_weight])` global batches, batched by you; or a
    dataset function `fn(input_context)` batching per replica.

    Args:
      x: inputs: arrays, a `tf.data.Dataset` or a dataset function.
      y: targets (arrays only; a dataset carries its own).
      sample_weight: per-example weights (arrays only).
      epochs: total epochs; a resumed run trains only the missing ones.
      global_batch_size: examples per step over all replicas, for arrays
        (default 64); must divide by the replica count. A dataset sets its
        own batch.
      steps_per_epoch: steps per epoch. Defaults to one pass over the data
        (`len(x) // global_batch_size`, or the dataset's length); needed for
        an infinite dataset or one whose length TF does not know.
      validation_data: `(x_val, y_val[, sample_weight])`, a dataset or a
        dataset function, evaluated after each epoch (`val_` logs).
      seed: fixes every epoch's shuffle order of arrays (`data.epoch_order`).
      shuffle: shuffle arrays each epoch (a dataset shuffles itself).

    Returns:
      A `TrainResult`.

    Raises:
      ValueError, TypeError: bad inputs or sizes (indivisible batch, too few
        examples, a dataset of unknown length without `steps_per_epoch`),
        or a checkpoint saved mid-epoch beyond `steps_per_epoch`.
      NonFiniteLossError: the loss became NaN/inf; the last good checkpoint
        is kept and the message names the step.
      tfmgpu.training.checkpoints.PreemptedError: SIGTERM arrived (with a
        `model_dir`); every worker saved a checkpoint at the same step. Call
        `fit` again (in a new process) to resume from it.
    """
    source = inputs.from_user(x, y, sample_weight)
    global_batch_size = self._global_batch(source, global_batch_size)
    steps_per_epoch = self._steps_per_epoch(
        source, epochs=epochs, global_batch_size=global_batch_size,
        steps_per_epoch=steps_per_epoch)
    runner = self._make_runner(source, global_batch_size=global_batch_size,
                               steps_per_epoch=steps_per_epoch, seed=seed,
                               shuffle=shuffle)
    # The lock before the summary writer opens its file.
    with self._hold_run_dir(), self._optimizer_on_model():
      controller = Controller(runner, self._loop_options(global_batch_size,
                                                         validation_data))
      try:
        with self._watch_preemption() as watcher:
          return controller.run(epochs=epochs,
                                steps_per_epoch=steps_per_epoch,
                                watcher=watcher)
      finally:
        self._eval_held = None  # Validation data held for this fit only.

  def _global_batch(self, source: inputs.InputData,
                    global_batch_size: int | None) -> int | None:
    """The arrays' global batch (checked); `None` for a user's dataset."""
    if isinstance(source, inputs.ArrayData):
      global_batch_size = global_batch_size or DEFAULT_GLOBAL_BATCH
      data_lib.check_global_batch(global_batch_size, self.num_replicas)
      return global_batch_size
    if global_batch_size is not None:
      raise ValueError(
          f"global_batch_size={global_batch_size} is for arrays: a "
          "tf.data.Dataset is batched by you (each element one global "
          "batch), a dataset function by "
          "input_context.get_per_replica_batch_size(...). Leave it unset.")
    return None

  def _steps_per_epoch(self, source: inputs.InputData, *, epochs: int,
                       global_batch_size: int | None,
                       steps_per_epoch: int | None) -> int:
    """Checks the sizes; returns the steps of one epoch."""
    if isinstance(source, inputs.ArrayData):
      full = steps_in_one_pass(source.num_examples, epochs=epochs,
                               global_batch_size=global_batch_size)
    else:
      if epochs < 1:
        raise ValueError(f"epochs={epochs} must be >= 1.")
      full = _dataset_steps(source, self.strategy, steps_per_epoch)
    if steps_per_epoch is not None and steps_per_epoch < 1:
      raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1.")
    steps_per_epoch = steps_per_epoch or full
    if full is not None and steps_per_epoch > full:
      raise ValueError(f"steps_per_epoch={steps_per_epoch} needs more data "
                       f"than one pass gives ({full} steps); use at most "
                       f"{full}, or repeat the dataset.")
    return steps_per_epoch

  def _make_runner(self, source: inputs.InputData, *,
                   global_batch_size: int | None, steps_per_epoch: int,
                   seed: int, shuffle: bool) -> runners.SyncRunner:
    feed, refusal = self._feed(source)
    logging.info("Training data: %s.", _describe_input(source, feed, refusal))
    return runners.SyncRunner(
        self._train_fn(global_batch_size, feed), self.strategy, source,
        global_batch_size=global_batch_size,
        steps_per_execution=self.steps_per_execution, seed=seed,
        shuffle=shuffle, steps_per_epoch=steps_per_epoch, feed=feed)

  def _feed(self, source: inputs.InputData) -> tuple[str, str | None]:
    """How `source` feeds the replicas (`tfmgpu.training.feeds`), and why
    a dataset is not split on the host (`None` when it is, or for arrays)."""
    if isinstance(source, inputs.ArrayData):
      device = resident.use_device_data(self.input_mode, self.strategy,
                                        source.data)
      return (feeds.DEVICE if device else feeds.ITERATOR), None
    if self.input_mode == "device":
      raise ValueError("input_mode='device' holds in-memory arrays on the "
                       f"devices; x is a {type(source).__name__}. Use "
                       "input_mode='auto' or 'tf_data'.")
    if isinstance(source, inputs.DatasetFnData):
      return feeds.ITERATOR, None
    refusal = self._split_refusal(source)
    return (feeds.ITERATOR if refusal else feeds.HOST_SPLIT), refusal

  def _split_refusal(self, source: inputs.DatasetData) -> str | None:
    """Why `source` is not split on the host (`None`: it is)."""
    if self.input_mode == "tf_data":
      return "input_mode='tf_data'"
    return feeds.host_split_refusal(self.strategy,
                                    source.dataset.element_spec)

  def close(self) -> None:
    """Flushes summaries and removes a non-chief worker's temporary files."""
    if self._writer is not None:
      self._writer.close()
    if self._checkpointer is not None:
      self._checkpointer.close()
