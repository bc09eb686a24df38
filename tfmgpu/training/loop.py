"""The training loop: epochs, steps per execution, evaluation, callbacks,
progress, checkpoints and summaries.

The outermost of the three layers. `Trainer` owns the optimizer (built in
the strategy's scope before the first step, which Keras 3 needs inside a
distributed `tf.function`) and drives the compiled functions of
`tfmgpu.training.distributed`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, Sequence

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu.training import allreduce as allreduce_lib
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import distributed
from tfmgpu.training import fused as fused_lib
from tfmgpu.training import preemption as preemption_lib
from tfmgpu.training import resident
from tfmgpu.training import step as step_lib


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN or infinite loss."""


def _watching_preemption(fit):
  """Runs `fit` with SIGTERM caught (`self._watcher`) if it checkpoints."""
  @functools.wraps(fit)
  def wrapper(self, *args, **kwargs):
    if not self.model_dir:
      return fit(self, *args, **kwargs)
    with preemption_lib.PreemptionWatcher(self.strategy) as watcher:
      self._watcher = watcher  # pylint: disable=protected-access
      try:
        return fit(self, *args, **kwargs)
      finally:
        self._watcher = None  # pylint: disable=protected-access
  return wrapper


@dataclasses.dataclass
class TrainResult:
  """What a `Trainer.fit` call produced.

  Attributes:
    history: per-epoch lists: `loss`, `accuracy`, `val_loss`, `val_accuracy`,
      `examples_per_sec`.
    epochs_run: epochs trained in this call (after any resume).
    initial_epoch: epochs already done when this call started (resumed).
    steps: optimizer steps taken in this call.
    examples_per_sec: training throughput over this call, excluding the
      first (tracing) call.
    checkpoint: the last checkpoint written, if any.
    initial_step: the global step this call started from (resumed).
  """
  history: dict[str, list[float]]
  epochs_run: int
  initial_epoch: int
  steps: int
  examples_per_sec: float
  checkpoint: str | None
  initial_step: int = 0


_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "sgd": keras.optimizers.SGD,
    "momentum": lambda learning_rate, **kw: keras.optimizers.SGD(
        learning_rate, momentum=0.9, **kw),
    "rmsprop": keras.optimizers.RMSprop,
    "adamw": keras.optimizers.AdamW,
}
OPTIMIZER_CHOICES = tuple(_OPTIMIZERS)


def make_optimizer(name: str, learning_rate: float, *,
                   clip_norm: float | None = None,
                   fused: bool = True) -> keras.optimizers.Optimizer:
  """Builds an optimizer by name (see `OPTIMIZER_CHOICES`).

  Args:
    name: one of `OPTIMIZER_CHOICES`.
    learning_rate: the step size (> 0).
    clip_norm: the optimizer's own `global_clipnorm` (the Trainer clips the
      all-reduced gradient itself and passes `None`).
    fused: use the one-kernel update of `tfmgpu.training.fused` where one
      exists (Adam, AdamW, SGD); same math as the Keras class.
  """
  if name not in _OPTIMIZERS:
    raise ValueError(f"optimizer={name!r} is unknown. Choose one of "
                     f"{', '.join(OPTIMIZER_CHOICES)}.")
  if not learning_rate > 0:
    raise ValueError(f"learning_rate={learning_rate} must be > 0.")
  kwargs = {"global_clipnorm": clip_norm} if clip_norm else {}
  optimizer = _OPTIMIZERS[name](learning_rate=learning_rate, **kwargs)
  return fused_lib.fuse(optimizer) if fused else optimizer


def _uses_float16(model: keras.Model) -> bool:
  return any(getattr(l, "dtype_policy", None) is not None
             and l.dtype_policy.name == "mixed_float16" for l in model.layers)


def _check_built_in_scope(model: keras.Model,
                          strategy: tf.distribute.Strategy) -> None:
  if not model.trainable_variables:
    raise ValueError(f"model {model.name!r} has no trainable variables: build "
                     "it (give it an Input or call it once) before training.")
  if strategy.num_replicas_in_sync == 1 and not strategy.extended._in_multi_worker_mode():  # pylint: disable=protected-access
    return
  v = model.trainable_variables[0]
  if not strategy.extended.variable_created_in_scope(getattr(v, "value", v)):
    raise ValueError(
        f"model {model.name!r} was not built in the scope of the strategy "
        f"({type(strategy).__name__}, {strategy.num_replicas_in_sync} "
        "replicas): its variables would not be mirrored. Build it under "
        "`with strategy.scope():` (tfmgpu.build_model does this for you).")


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
    loss: see `tfmgpu.training.step.per_example_loss_fn`.
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
      examples.
    model_dir: where checkpoints and TensorBoard summaries go; `None` keeps
      nothing. A directory with checkpoints is resumed from.
    callbacks: Keras callbacks (epoch/batch hooks, `model.stop_training`).
    verbose: 1 shows a progress bar per epoch, 0 logs one line per epoch.
  """

  def __init__(self, model: keras.Model, *,
               strategy: tf.distribute.Strategy | None = None,
               optimizer: str | keras.optimizers.Optimizer = "adam",
               learning_rate: float = 1e-3, clip_norm: float | None = None,
               gradient_compression: str = "none", bytes_per_pack: int = 0,
               loss: Any = None, steps_per_execution: int = 1,
               jit_compile: bool = False, fused_optimizer: bool = True,
               input_mode: str = "auto", model_dir: str | None = None,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               verbose: int = 1):
    if steps_per_execution < 1:
      raise ValueError(f"steps_per_execution={steps_per_execution} must be >= 1.")
    self.model = model
    self.strategy = strategy or tf.distribute.get_strategy()
    self.loss = loss
    self.steps_per_execution = steps_per_execution
    resident.check_input_mode(input_mode, self.strategy)
    self.input_mode = input_mode
    self.jit_compile = jit_compile
    self.model_dir = model_dir
    self.verbose = verbose
    _check_built_in_scope(model, self.strategy)
    # tfmgpu sums replica gradients itself (then clips), except under
    # parameter servers, where gradients go to the variables' servers.
    owns_allreduce = not isinstance(
        self.strategy, tf.distribute.experimental.ParameterServerStrategy)
    self.allreduce = allreduce_lib.AllReduceOptions(
        compression=gradient_compression, bytes_per_pack=bytes_per_pack,
        clip_norm=clip_norm) if owns_allreduce else None
    with self.strategy.scope():
      if isinstance(optimizer, str):
        optimizer = make_optimizer(
            optimizer, learning_rate,
            clip_norm=None if owns_allreduce else clip_norm,
            fused=fused_optimizer)
      if _uses_float16(model) and not isinstance(
          optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
      # Keras 3 optimizers must be built in scope before a distributed step.
      build = getattr(model, "build_optimizer", None)
      if build is not None:
        build(optimizer)  # Staged models place each stage's slots themselves.
      else:
        optimizer.build(model.trainable_variables)
    if owns_allreduce:
      allreduce_lib.take_over_aggregation(optimizer)
    self.optimizer = optimizer
    self.callbacks = list(callbacks)
    self._train_fns: dict[tuple[int, bool], Any] = {}
    self._eval_fn = None
    self._checkpointer = None
    self._watcher: preemption_lib.PreemptionWatcher | None = None
    self._writer = None
    self._writes_summaries = False

  # ------------------------------------------------------------ helpers

  @property
  def num_replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

  def _train_fn(self, global_batch_size: int, device_data: bool = False):
    key = (global_batch_size, device_data)
    if key not in self._train_fns:
      step = step_lib.make_train_step(
          self.model, self.optimizer, global_batch_size=global_batch_size,
          loss=self.loss, jit_compile=self.jit_compile,
          allreduce=self.allreduce)
      self._train_fns[key] = distributed.make_train_function(
          self.strategy, step,
          check_fn=lambda: step_lib.non_finite_weights(self.model),
          device_data=device_data)
    return self._train_fns[key]

  def _checkpoints(self) -> ckpt_lib.Checkpointer | None:
    if self.model_dir and self._checkpointer is None:
      self._checkpointer = ckpt_lib.Checkpointer(
          self.model_dir, self.strategy, model=self.model,
          optimizer=self.optimizer)
    return self._checkpointer

  def _summary_writer(self):
    if self._writer is None:
      self._writes_summaries = bool(self.model_dir) and ckpt_lib.is_chief(
          self.strategy)
      if self._writes_summaries:
        self._writer = tf.summary.create_file_writer(
            os.path.join(self.model_dir, "summaries"))
      else:
        self._writer = tf.summary.create_noop_writer()
    return self._writer

  # --------------------------------------------------------------- API

  def evaluate(self, x: np.ndarray, y: np.ndarray, *,
               global_batch_size: int = 256) -> dict[str, float]:
    """Loss and accuracy over every example of `(x, y)` (no row dropped).

    Returns:
      `{"loss": mean loss, "accuracy": fraction correct, "count": rows}`.
    """
    data_lib.check_global_batch(global_batch_size, self.num_replicas)
    if self._eval_fn is None:
      self._eval_fn = distributed.make_eval_function(
          self.strategy, step_lib.make_eval_step(self.model, loss=self.loss))
    x, y, mask = data_lib.pad_to_multiple(x, y, global_batch_size)
    dataset = data_lib.distribute(
        self.strategy, x, y, sample_weight=mask,
        global_batch_size=global_batch_size, shuffle=False,
        drop_remainder=True)
    out = {k: float(v) for k, v in self._eval_fn(dataset).items()}
    n = max(out["count"], 1.0)
    return {"loss": out["loss_sum"] / n, "accuracy": out["correct"] / n,
            "count": out["count"]}

  @_watching_preemption
  def fit(self, x: np.ndarray, y: np.ndarray, *, epochs: int = 1,
          global_batch_size: int = 64, steps_per_epoch: int | None = None,
          validation_data: tuple[np.ndarray, np.ndarray] | None = None,
          seed: int = 0, shuffle: bool = True) -> TrainResult:
    """Trains for `epochs` (resuming from `model_dir` if it has checkpoints).

    Args:
      x, y: training features and integer labels.
      epochs: total epochs; a resumed run trains only the missing ones.
      global_batch_size: examples per step over all replicas; must divide
        by the replica count.
      steps_per_epoch: steps per epoch. Defaults to one pass over the data
        (`len(x) // global_batch_size`).
      validation_data: `(x_val, y_val)` evaluated after each epoch.
      seed: fixes every epoch's shuffle order (`data.epoch_order`).
      shuffle: shuffle each epoch.

    Returns:
      A `TrainResult`.

    Raises:
      ValueError: bad sizes (indivisible batch, too few examples), or a
        checkpoint saved mid-epoch beyond `steps_per_epoch`.
      NonFiniteLossError: the loss became NaN/inf; the last good checkpoint
        is kept and the message names the step.
      tfmgpu.training.checkpoints.PreemptedError: SIGTERM arrived (with a
        `model_dir`); every worker saved a checkpoint at the same step. Call
        `fit` again (in a new process) to resume from it.
    """
    data_lib.check_global_batch(global_batch_size, self.num_replicas)
    full = steps_in_one_pass(len(x), epochs=epochs,
                             global_batch_size=global_batch_size)
    steps_per_epoch = steps_per_epoch or full
    if steps_per_epoch > full:
      raise ValueError(f"steps_per_epoch={steps_per_epoch} needs more data "
                       f"than one pass gives ({full} steps of "
                       f"{global_batch_size}); use at most {full}.")
    checkpointer = self._checkpoints()
    initial_epoch = checkpointer.restore_latest() if checkpointer else 0
    progress = checkpointer.progress if checkpointer else ckpt_lib.Progress()
    skip = progress.epoch_step  # Steps of epoch initial_epoch + 1 already done.
    if skip >= steps_per_epoch:
      raise ValueError(
          f"The checkpoint in {checkpointer.chief_directory} was saved {skip} "
          f"steps into epoch {initial_epoch + 1}, but steps_per_epoch="
          f"{steps_per_epoch}. Resume with the steps_per_epoch and "
          "global_batch_size of the run that wrote it.")
    if initial_epoch >= epochs:
      logging.info("model_dir already holds %d epoch(s) >= epochs=%d; nothing "
                   "to train.", initial_epoch, epochs)
    device_data = resident.use_device_data(self.input_mode, self.strategy,
                                           x, y)
    logging.info("Training data: %s.", "on each replica's device"
                 if device_data else "tf.data pipeline")
    held = (resident.DeviceData(self.strategy, x, y)
            if device_data and initial_epoch < epochs else None)
    train_fn = self._train_fn(global_batch_size, device_data)
    callbacks = keras.callbacks.CallbackList(
        self.callbacks, add_history=False, add_progbar=False, model=self.model,
        epochs=epochs, steps=steps_per_epoch, verbose=0)
    history: dict[str, list[float]] = {}
    total_steps, timed_examples, timed_seconds = 0, 0, 0.0
    global_step = progress.step
    last_ckpt = checkpointer.latest if checkpointer else None
    self.model.stop_training = False
    callbacks.on_train_begin()
    writer = self._summary_writer()
    for epoch in range(initial_epoch, epochs):
      callbacks.on_epoch_begin(epoch)
      first_step = skip if epoch == initial_epoch else 0
      if held is not None:
        batches = held.epoch(global_batch_size=global_batch_size,
                             steps=steps_per_epoch, seed=seed, epoch=epoch,
                             shuffle=shuffle)
      else:
        iterator = iter(self._epoch_dataset(
            x, y, global_batch_size=global_batch_size, shuffle=shuffle,
            seed=seed, epoch=epoch, first_step=first_step))
      bar = (keras.utils.Progbar(steps_per_epoch, stateful_metrics=[
          "loss", "accuracy", "examples/s"]) if self.verbose else None)
      if bar is not None:
        print(f"Epoch {epoch + 1}/{epochs}", flush=True)
      loss_sum, correct, count, done = 0.0, 0.0, 0.0, first_step
      while done < steps_per_epoch:
        n = min(self.steps_per_execution, steps_per_epoch - done)
        start = time.perf_counter()
        source = batches.from_step(done) if held is not None else iterator
        out = train_fn(source, tf.constant(n))
        step_loss = float(out["loss"])
        elapsed = time.perf_counter() - start
        if not math.isfinite(step_loss) or float(out["non_finite"]):
          first = global_step + 1
          what = (step_loss if not math.isfinite(step_loss) else
                  f"non-finite (loss {step_loss:.4g} but NaN/inf weights)")
          raise NonFiniteLossError(
              f"Loss became {what} at step {first}"
              + (f"-{first + n - 1}" if n > 1 else "")
              + f" (epoch {epoch + 1}). Training stopped; the last good "
              f"checkpoint is {last_ckpt or 'none (no model_dir)'}. Lower "
              "the learning rate or set clip_norm.")
        if total_steps or epoch > initial_epoch:  # First call traces: not timed.
          timed_examples += n * global_batch_size
          timed_seconds += elapsed
        loss_sum += step_loss
        correct += float(out["correct"])
        count += float(out["count"])
        done += n
        total_steps += n
        global_step += n
        logs = {"loss": loss_sum / (done - first_step),
                "accuracy": correct / max(count, 1.0)}
        rate = n * global_batch_size / elapsed if elapsed > 0 else 0.0
        if bar is not None:
          bar.update(done, values=list(logs.items()) + [("examples/s", rate)])
        callbacks.on_train_batch_end(done - 1, logs)
        if self._writes_summaries:  # ~0.3 ms of Python per call otherwise.
          with writer.as_default(step=global_step):
            tf.summary.scalar("train/loss", step_loss / n)
            tf.summary.scalar("train/examples_per_sec", rate)
        if (self._watcher and done < steps_per_epoch and
            self._watcher.stop_requested()):
          writer.flush()
          self._preempted(checkpointer, checkpointer.save(
              epoch, step=global_step, epoch_step=done), global_step, epoch,
                          done, steps_per_epoch)
      last_ckpt = self._finish_epoch(
          epoch, epochs, logs, history=history, callbacks=callbacks,
          writer=writer, checkpointer=checkpointer, global_step=global_step,
          validation_data=validation_data, global_batch_size=global_batch_size,
          examples_per_sec=(timed_examples / timed_seconds
                            if timed_seconds else 0.0)) or last_ckpt
      if (self._watcher and epoch + 1 < epochs and
          self._watcher.stop_requested()):
        writer.flush()
        self._preempted(checkpointer, last_ckpt, global_step, epoch + 1, 0,
                        steps_per_epoch)
      if self.model.stop_training:
        logging.info("A callback stopped training after epoch %d.", epoch + 1)
        break
    callbacks.on_train_end(history)
    writer.flush()
    return TrainResult(
        history=history, epochs_run=len(history.get("loss", [])),
        initial_epoch=initial_epoch, steps=total_steps,
        examples_per_sec=timed_examples / timed_seconds if timed_seconds else 0.0,
        checkpoint=last_ckpt if checkpointer and checkpointer.chief else None,
        initial_step=progress.step)

  def _epoch_dataset(self, x: np.ndarray, y: np.ndarray, *,
                     global_batch_size: int, shuffle: bool, seed: int,
                     epoch: int, first_step: int):
    """The epoch's distributed dataset, from step `first_step` on (resume)."""
    if not first_step:
      return data_lib.distribute(
          self.strategy, x, y, global_batch_size=global_batch_size,
          shuffle=shuffle, seed=seed, epoch=epoch, drop_remainder=True)
    # The rest of the same order: with `input_fn`'s interleaved sharding, each
    # global batch is a contiguous slice of the epoch's order.
    order = data_lib.epoch_indices(len(x), seed=seed, epoch=epoch,
                                   shuffle=shuffle)
    rest = order[first_step * global_batch_size:]
    return data_lib.distribute(
        self.strategy, x[rest], y[rest], global_batch_size=global_batch_size,
        shuffle=False, drop_remainder=True)

  def _preempted(self, checkpointer: ckpt_lib.Checkpointer, checkpoint: str,
                 global_step: int, epoch: int, epoch_step: int,
                 steps_per_epoch: int) -> None:
    """Raises `PreemptedError` after the checkpoint of a SIGTERM was saved."""
    if not checkpointer.chief:  # Name the chief's copy, which is kept.
      checkpoint = os.path.join(checkpointer.chief_directory,
                                os.path.basename(checkpoint))
    where = (f"{epoch_step} of {steps_per_epoch} steps into epoch {epoch + 1}"
             if epoch_step else f"the end of epoch {epoch}")
    who = ("this process" if self._watcher.received else "another worker")
    raise ckpt_lib.PreemptedError(
        f"Preempted: SIGTERM reached {who}. Saved {checkpoint} at global step "
        f"{global_step} ({where}). Run the same command again to resume from "
        f"there (python -m tfmgpu.train exits with code "
        f"{ckpt_lib.EXIT_PREEMPTED}).", checkpoint=checkpoint, step=global_step)

  def _finish_epoch(self, epoch: int, epochs: int, logs: dict[str, float], *,
                    history: dict[str, list[float]], callbacks, writer,
                    checkpointer, global_step: int, validation_data,
                    global_batch_size: int, examples_per_sec: float
                    ) -> str | None:
    """Validation, history, summaries, checkpoint, callbacks for one epoch.

    Returns:
      The checkpoint written, or `None` without a `model_dir`.
    """
    epoch_logs = dict(logs)
    if validation_data is not None:
      val = self.evaluate(*validation_data, global_batch_size=global_batch_size)
      epoch_logs.update(val_loss=val["loss"], val_accuracy=val["accuracy"])
    epoch_logs["examples_per_sec"] = examples_per_sec
    for k, v in epoch_logs.items():
      history.setdefault(k, []).append(v)
    with writer.as_default(step=epoch + 1):
      for k, v in epoch_logs.items():
        tf.summary.scalar(f"epoch/{k}", v)
    saved = (checkpointer.save(epoch + 1, step=global_step) if checkpointer
             else None)
    if not self.verbose:
      logging.info("epoch %d/%d: %s", epoch + 1, epochs, ", ".join(
          f"{k}={v:.4g}" for k, v in epoch_logs.items()))
    callbacks.on_epoch_end(epoch, epoch_logs)
    return saved

  def close(self) -> None:
    """Flushes summaries and removes a non-chief worker's temporary files."""
    if self._writer is not None:
      self._writer.close()
    if self._checkpointer is not None:
      self._checkpointer.close()
