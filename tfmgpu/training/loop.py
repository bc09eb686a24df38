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
import os
from typing import Any, Sequence

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu.training import allreduce as allreduce_lib
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import distributed
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
    raise ValueError(f"model {model.name!r} has no trainable variables: build "
                     "it (give it an Input or call it once) before training.")
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
    self.optimizer = prepare_optimizer(
        optimizer, model, self.strategy, learning_rate=learning_rate,
        clip_norm=None if owns_allreduce else clip_norm, fused=fused_optimizer)
    if owns_allreduce:
      allreduce_lib.take_over_aggregation(self.optimizer)
    self.callbacks = list(callbacks)
    self._train_fns: dict[tuple[int, bool], Any] = {}
    self._eval_fn = None
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

  def _train_fn(self, global_batch_size: int, device_data: bool = False):
    key = (global_batch_size, device_data)
    if key not in self._train_fns:
      step = step_lib.make_train_step(
          self.model, self.optimizer, global_batch_size=global_batch_size,
          loss=self.loss, jit_compile=self.jit_compile,
          allreduce=self.allreduce)
      self._train_fns[key] = self._make_train_function(step, device_data)
    return self._train_fns[key]

  def _make_train_function(self, step, device_data: bool):
    """The distributed function that runs `step` several times per call."""
    return distributed.make_train_function(
        self.strategy, step,
        check_fn=lambda: step_lib.non_finite_weights(self.model),
        device_data=device_data)

  def _summaries(self) -> tuple[Any, bool]:
    """The summary writer (a no-op one off the chief) and whether it writes."""
    writes = bool(self.model_dir) and ckpt_lib.is_chief(self.strategy)
    if self._writer is None:
      self._writer = (tf.summary.create_file_writer(
          os.path.join(self.model_dir, "summaries")) if writes
                      else tf.summary.create_noop_writer())
    return self._writer, writes

  def _loop_options(self, global_batch_size: int, validation_data
                    ) -> LoopOptions:
    writer, writes = self._summaries()

    def validate() -> dict[str, float]:
      val = self.evaluate(*validation_data, global_batch_size=global_batch_size)
      return {"val_loss": val["loss"], "val_accuracy": val["accuracy"]}

    return LoopOptions(
        model=self.model,
        global_batch_size=global_batch_size, callbacks=self.callbacks,
        verbose=self.verbose, checkpointer=self.checkpointer,
        summary_writer=writer, writes_summaries=writes,
        validate=validate if validation_data is not None else None)

  def _watch_preemption(self):
    """SIGTERM becomes a checkpoint when the run keeps checkpoints."""
    if not self.model_dir:
      return contextlib.nullcontext()
    return preemption_lib.PreemptionWatcher(self.strategy)

  # --------------------------------------------------------------- API

  def evaluate(self, x: np.ndarray, y: np.ndarray, *,
               global_batch_size: int = 256) -> dict[str, float]:
    """Loss and accuracy over every example of `(x, y)` (no row dropped).

    Returns:
      `{"loss": mean loss, "accuracy": fraction correct, "count": rows}`.
    """
    if self._eval_fn is None:
      self._eval_fn = self._make_eval_fn()
    dataset = self._eval_dataset(x, y, global_batch_size)
    out = {k: float(v) for k, v in self._eval_fn(dataset).items()}
    n = max(out["count"], 1.0)
    return {"loss": out["loss_sum"] / n, "accuracy": out["correct"] / n,
            "count": out["count"]}

  def _make_eval_fn(self):
    return distributed.make_eval_function(
        self.strategy, step_lib.make_eval_step(self.model, loss=self.loss))

  def _eval_dataset(self, x: np.ndarray, y: np.ndarray,
                    global_batch_size: int):
    """Every row once: the last batch padded and masked out."""
    data_lib.check_global_batch(global_batch_size, self.num_replicas)
    x, y, mask = data_lib.pad_to_multiple(x, y, global_batch_size)
    return data_lib.distribute(
        self.strategy, x, y, sample_weight=mask,
        global_batch_size=global_batch_size, shuffle=False,
        drop_remainder=True)

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
    steps_per_epoch = self._steps_per_epoch(
        len(x), epochs=epochs, global_batch_size=global_batch_size,
        steps_per_epoch=steps_per_epoch)
    runner = self._make_runner(x, y, global_batch_size=global_batch_size,
                               steps_per_epoch=steps_per_epoch, seed=seed,
                               shuffle=shuffle)
    controller = Controller(runner, self._loop_options(global_batch_size,
                                                       validation_data))
    with self._watch_preemption() as watcher:
      return controller.run(epochs=epochs, steps_per_epoch=steps_per_epoch,
                            watcher=watcher)

  def _steps_per_epoch(self, num_examples: int, *, epochs: int,
                       global_batch_size: int,
                       steps_per_epoch: int | None) -> int:
    """Checks the sizes; returns the steps of one epoch."""
    data_lib.check_global_batch(global_batch_size, self.num_replicas)
    full = steps_in_one_pass(num_examples, epochs=epochs,
                             global_batch_size=global_batch_size)
    steps_per_epoch = steps_per_epoch or full
    if steps_per_epoch > full:
      raise ValueError(f"steps_per_epoch={steps_per_epoch} needs more data "
                       f"than one pass gives ({full} steps of "
                       f"{global_batch_size}); use at most {full}.")
    return steps_per_epoch

  def _make_runner(self, x: np.ndarray, y: np.ndarray, *,
                   global_batch_size: int, steps_per_epoch: int, seed: int,
                   shuffle: bool) -> runners.SyncRunner:
    device_data = resident.use_device_data(self.input_mode, self.strategy,
                                           x, y)
    logging.info("Training data: %s.", "on each replica's device"
                 if device_data else "tf.data pipeline")
    return runners.SyncRunner(
        self._train_fn(global_batch_size, device_data), self.strategy, x, y,
        global_batch_size=global_batch_size,
        steps_per_execution=self.steps_per_execution, seed=seed,
        shuffle=shuffle, steps_per_epoch=steps_per_epoch,
        device_data=device_data)

  def close(self) -> None:
    """Flushes summaries and removes a non-chief worker's temporary files."""
    if self._writer is not None:
      self._writer.close()
    if self._checkpointer is not None:
      self._checkpointer.close()
