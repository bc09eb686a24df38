"""The outer training loop: one `Controller` for every runner.

The controller owns everything around the steps: epochs and the resume
point, Keras callbacks, the progress bar, TensorBoard summaries, the
non-finite check, preemption points (SIGTERM -> checkpoint ->
`PreemptedError`) and the `TrainResult`. A runner
(`tfmgpu.training.runners`) only "runs up to n steps and returns their
sums"; a synchronous `strategy.run` runner and the parameter-server
coordinator runner plug into the same loop, so each loop feature exists
once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import rundir
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import preemption as preemption_lib
from tfmgpu.training import progress as progress_lib
from tfmgpu.training import replica_state
from tfmgpu.training import step_errors
from tfmgpu.training import workers


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN or infinite loss."""


@dataclasses.dataclass
class TrainResult:
  """What a `Trainer.fit` call produced.

  Attributes:
    history: per-epoch lists: `loss`, each metric by name (`accuracy` with
      the default loss), their `val_` twins with validation data, and
      `examples_per_sec`.
    epochs_run: epochs trained in this call (after any resume).
    initial_epoch: epochs already done when this call started (resumed).
    steps: optimizer steps taken in this call.
    examples_per_sec: training throughput over this call, excluding the
      first (tracing) call when there were others.
    checkpoint: the last checkpoint written, if any.
    initial_step: the global step this call started from (resumed).
    step_seconds: the median seconds per step of this call's calls after
      the first (tracing) one; NaN when only that one ran.
  """
  history: dict[str, list[float]]
  epochs_run: int
  initial_epoch: int
  steps: int
  examples_per_sec: float
  checkpoint: str | None
  initial_step: int = 0
  step_seconds: float = float("nan")


@dataclasses.dataclass
class StepSums:
  """What a runner returns for one call: steps run and their summed results.

  Attributes:
    steps: steps run.
    loss: the sum of the steps' mean losses.
    count: examples.
    loss_rows: the sum of the steps' mean losses, each times its rows.
    non_finite: > 0 when the loss or a weight became NaN/inf.
    metrics: each metric state's summed change (`Objective.results` turns
      an epoch's sum into the metric values).
  """
  steps: int
  loss: float
  count: float
  non_finite: float = 0.0
  metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
  loss_rows: float = 0.0

  @property
  def mean_loss(self) -> float:
    """The steps' losses weighed by their rows, as Keras reports an
    epoch's (a short last batch counts for its rows)."""
    if self.count:
      return self.loss_rows / self.count
    return self.loss / max(self.steps, 1)

  def to_text(self) -> str:
    """The sums as JSON, exactly (floats as Python writes them, each
    metric state with its dtype and shape): saved in mid-epoch checkpoints
    so that a resumed epoch reports all its steps."""
    metrics = {k: [str(np.asarray(v).dtype), np.asarray(v).tolist()]
               for k, v in self.metrics.items()}
    return json.dumps(dict(steps=self.steps, loss=self.loss,
                           count=self.count, loss_rows=self.loss_rows,
                           non_finite=self.non_finite, metrics=metrics))

  @classmethod
  def from_text(cls, text: str) -> "StepSums":
    """The sums `to_text` wrote."""
    saved = json.loads(text)
    saved["metrics"] = {k: np.asarray(v, dtype=dtype)
                        for k, (dtype, v) in saved["metrics"].items()}
    return cls(**saved)

  def __add__(self, other: "StepSums") -> "StepSums":
    keys = set(self.metrics) | set(other.metrics)
    return StepSums(
        steps=self.steps + other.steps, loss=self.loss + other.loss,
        count=self.count + other.count,
        loss_rows=self.loss_rows + other.loss_rows,
        non_finite=self.non_finite + other.non_finite,
        metrics={k: self.metrics.get(k, 0.0) + other.metrics.get(k, 0.0)
                 for k in keys})


class StepRunner(Protocol):
  """Runs training steps; the controller does everything else.

  Attributes:
    coordinator_only: `True` when only this process (a parameter-server
      coordinator) sees SIGTERM; `False` when any worker may.
    steps_per_execution: steps per call of the step function (a runner may
      run several calls in one `run`: the coordinator's join).
  """
  coordinator_only: bool
  steps_per_execution: int

  def start_epoch(self, epoch: int, first_step: int) -> None:
    """Prepares the input of `epoch`, starting at step `first_step` of it."""

  def run(self, done: int, limit: int) -> StepSums:
    """Runs between 1 and `limit` steps from step `done` of the epoch."""


def non_finite_message(sums: StepSums, *, first_step: int, epoch: int,
                       last_checkpoint: str | None, has_model_dir: bool,
                       weights: Sequence[str] = ()) -> str:
  """The one wording of a non-finite loss (names the steps, the weights
  that hold NaN/inf, and the rescue)."""
  named = (": " + ", ".join(weights[:3]) + (" ..." if len(weights) > 3
                                            else "")) if weights else ""
  what = (sums.loss if not math.isfinite(sums.loss) else
          f"non-finite (loss {sums.loss:.4g} but NaN/inf weights{named})")
  steps = (f"{first_step}-{first_step + sums.steps - 1}" if sums.steps > 1
           else f"{first_step}")
  kept = last_checkpoint or ("none yet" if has_model_dir
                             else "none (no model_dir)")
  return (f"Loss became {what} at step {steps} (epoch {epoch + 1}). Training "
          f"stopped; the last good checkpoint is {kept}. Lower the learning "
          "rate or set clip_norm, and check the data for NaN/inf "
          "(np.isfinite(x).all()).")


def preempted_error(checkpointer: ckpt_lib.Checkpointer, checkpoint: str, *,
                    who: str, global_step: int, epoch: int, epoch_step: int,
                    steps_per_epoch: int, last: bool = False
                    ) -> ckpt_lib.PreemptedError:
  """The one `PreemptedError` for a checkpoint saved on SIGTERM (`last`:
  after the last epoch)."""
  if not checkpointer.chief:  # Name the chief's copy, which is kept.
    checkpoint = checkpointer.chief_path(checkpoint)
  where = (f"{epoch_step} of {steps_per_epoch} steps into epoch {epoch + 1}"
           if epoch_step else f"the end of epoch {epoch}")
  then = ("resume from there" if not last else "finish: training is done, "
          "it evaluates and saves the model")
  return ckpt_lib.PreemptedError(
      f"Preempted: {preemption_lib.signal_name()} reached {who}. Saved "
      f"{checkpoint} at global step "
      f"{global_step} ({where}). Run the same command again to {then} "
      f"(python -m tfmgpu.train exits with code {ckpt_lib.EXIT_PREEMPTED}, "
      "as does a script that leaves this error uncaught).",
      checkpoint=checkpoint, step=global_step)


class _Clock:
  """Training throughput that leaves out the first (tracing) call."""

  def __init__(self):
    self.calls, self.examples, self.seconds = 0, 0, 0.0
    self.first_examples, self.first_seconds = 0, 0.0
    self.per_step: list[float] = []  # Each call's seconds per step.

  def add(self, examples: int, seconds: float, steps: int = 1) -> None:
    if self.calls == 0:
      self.first_examples, self.first_seconds = examples, seconds
    else:
      self.examples += examples
      self.seconds += seconds
      self.per_step.append(seconds / max(steps, 1))
    self.calls += 1

  @property
  def step_seconds(self) -> float:
    """The median seconds per step after the first call (see
    `TrainResult.step_seconds`)."""
    return (statistics.median(self.per_step) if self.per_step
            else float("nan"))

  @property
  def rate(self) -> float:
    if self.seconds > 0:
      return self.examples / self.seconds
    # Only the first call ran: its rate (with tracing) beats printing 0.
    return (self.first_examples / self.first_seconds
            if self.first_seconds > 0 else 0.0)


class _HistoryRecorder(keras.callbacks.Callback):
  """Appends each epoch's logs to `history` after the user's callbacks, as
  Keras' `History` does, so that what they add (the `learning_rate` of
  `ReduceLROnPlateau`) is kept too."""

  def __init__(self, history: dict[str, list[float]]):
    super().__init__()
    self.history = history

  def on_epoch_end(self, epoch, logs=None):
    for k, v in (logs or {}).items():
      self.history.setdefault(k, []).append(v)


@dataclasses.dataclass
class LoopOptions:
  """What the controller needs besides the runner (see `Controller`)."""
  model: keras.Model
  # Its `finalize_variable_values` runs after the last epoch, as in Keras
  # `fit` (`use_ema=True` puts the moving averages into the weights).
  optimizer: keras.optimizers.Optimizer | None = None
  global_batch_size: int | None = None
  callbacks: Sequence[keras.callbacks.Callback] = ()
  verbose: int = 1
  checkpointer: ckpt_lib.Checkpointer | None = None
  summary_writer: Any = None
  writes_summaries: bool = False
  validate: Callable[[], dict[str, float]] | None = None
  metric_results: Callable[[dict[str, Any]], dict[str, float]] = (
      lambda sums: {})
  metric_names: Sequence[str] = ()
  # Periodic checkpoints besides the epoch ends (see `Controller._save_due`).
  checkpoint_every_steps: int | None = None
  checkpoint_every_s: float | None = None
  # Whether a flag holds on any worker (`workers.AnyWorker`): a callback's
  # `stop_training` on one worker stops them all after the same step.
  any_worker: Callable[[bool], bool] = bool


def _say_nothing_to_train(ckpt: ckpt_lib.Checkpointer, done: int,
                          epochs: int) -> None:
  """A warning, not INFO: a second `fit(epochs=1)` was taken for a second
  epoch (a trial), as Keras' `fit` would train one."""
  logging.warning(
      "fit(epochs=%d) trains nothing: the checkpoints in %s already hold %d "
      "epoch(s). epochs counts the run's total epochs (a resumed run trains "
      "only the missing ones; Keras' fit trains epochs more on each call): "
      "pass epochs=%d to train one more.", epochs,
      os.path.dirname(ckpt.chief_directory), done, done + 1)


def _restore(ckpt: ckpt_lib.Checkpointer, any_worker: Any) -> int:
  """`ckpt.restore_latest()`, the same checkpoint on every worker
  (`workers.require_same_start`); then the run directory's record, if it
  waited for a checkpoint to restore (`rundir.confirm_record`), is written."""
  model_dir = os.path.dirname(ckpt.chief_directory)
  try:
    epoch = ckpt.restore_latest()
  except ckpt_lib.UnreadableCheckpointError as e:
    raise rundir.unconfirmed_error(model_dir, e) from e
  workers.require_same_start(any_worker, ckpt)
  if ckpt.chief:
    rundir.confirm_record(model_dir)
  return epoch


def _finalize(optimizer: Any, model: keras.Model, steps_run: int) -> None:
  """`optimizer.finalize_variable_values`, as Keras `fit` ends (`use_ema`
  puts the averages into the weights) once the optimizer has stepped: in
  this run, or in the one whose checkpoint this run restored with nothing
  left to train (its weights are the trained ones, not the averages)."""
  if optimizer is None:
    return
  if steps_run or int(optimizer.iterations.numpy()) > 0:
    optimizer.finalize_variable_values(model.trainable_weights)


class Controller:
  """Runs epochs of a `StepRunner` with every loop feature, once.

  Args:
    runner: what runs the steps.
    options: the model, batch size, callbacks, verbosity,
      checkpointer, summary writer and validation of the run.
  """

  def __init__(self, runner: StepRunner, options: LoopOptions):
    self.runner = runner
    self.o = options
    self.clock = _Clock()
    self.history: dict[str, list[float]] = {}
    self.total_steps = 0
    self.global_step = 0
    self.last_checkpoint: str | None = None
    self.watcher: preemption_lib.PreemptionWatcher | None = None
    self._saved_at = (0, time.monotonic())  # Global step and time of a save.
    # The running sums of the epoch (saved with a mid-epoch checkpoint).
    self._epoch_sums = StepSums(steps=0, loss=0.0, count=0.0)

  def run(self, *, epochs: int, steps_per_epoch: int,
          watcher: preemption_lib.PreemptionWatcher | None = None
          ) -> TrainResult:
    """Trains the epochs the checkpoints do not hold yet.

    Raises:
      ValueError: a checkpoint saved further into an epoch than
        `steps_per_epoch` allows; workers resumed from different ones.
      NonFiniteLossError: the loss or the weights became NaN/inf.
      PreemptedError: SIGTERM arrived (`watcher`); a checkpoint was saved.
    """
    ckpt = self.o.checkpointer
    initial_epoch = _restore(ckpt, self.o.any_worker) if ckpt else 0
    progress = ckpt.progress if ckpt else ckpt_lib.Progress()
    self._check_resume_point(progress, initial_epoch, steps_per_epoch)
    if ckpt is not None and initial_epoch >= epochs:
      _say_nothing_to_train(ckpt, initial_epoch, epochs)
    self.watcher, self.global_step = watcher, progress.step
    self._saved_at = (progress.step, time.monotonic())
    self.last_checkpoint = ckpt.latest if ckpt else None
    callbacks = keras.callbacks.CallbackList(
        [*self.o.callbacks, _HistoryRecorder(self.history)],
        add_history=False, add_progbar=False,
        model=self.o.model, epochs=epochs, steps=steps_per_epoch, verbose=0)
    self.o.model.stop_training = False
    callbacks.on_train_begin()
    for epoch in range(initial_epoch, epochs):
      callbacks.on_epoch_begin(epoch)
      first = progress.epoch_step if epoch == initial_epoch else 0
      logs, done = self._run_epoch(epoch, epochs, first, steps_per_epoch,
                                   callbacks)
      # A callback's stop mid-epoch saves where it stopped (the epoch not
      # done), so that a rerun trains the rest of it.
      at = (epoch + 1, 0) if done >= steps_per_epoch else (epoch, done)
      self._finish_epoch(epoch, epochs, logs, callbacks, at)
      # SIGTERM stops (42) after the last epoch too: its log line said so.
      stopped, preempted = self._agree(sigterm=True)
      if preempted:
        self._preempt(*at, steps_per_epoch, self.last_checkpoint,
                      last=epoch + 1 >= epochs and not at[1])
      if stopped:
        logging.info("A callback stopped training in epoch %d%s.", epoch + 1,
                     f", after step {done} of {steps_per_epoch}; a rerun "
                     "resumes there" if at[1] else "")
        break
    _finalize(self.o.optimizer, self.o.model, self.total_steps)
    replica_state.agree(self.o.model)  # Replicas predict as the model saves.
    callbacks.on_train_end(self.history)
    self.o.summary_writer.flush()
    chief = ckpt is not None and ckpt.chief
    return TrainResult(
        history=self.history, epochs_run=len(self.history.get("loss", [])),
        initial_epoch=initial_epoch, steps=self.total_steps,
        examples_per_sec=self.clock.rate,
        step_seconds=self.clock.step_seconds,
        checkpoint=self.last_checkpoint if chief else None,
        initial_step=progress.step)

  def _check_resume_point(self, progress: ckpt_lib.Progress,
                          initial_epoch: int, steps_per_epoch: int) -> None:
    if progress.epoch_step >= steps_per_epoch:
      raise ValueError(
          f"The checkpoint in {self.o.checkpointer.chief_directory} was saved "
          f"{progress.epoch_step} steps into epoch {initial_epoch + 1}, but "
          f"steps_per_epoch={steps_per_epoch}. Resume with the "
          "steps_per_epoch and global_batch_size of the run that wrote it.")

  def _run_epoch(self, epoch: int, epochs: int, first: int,
                 steps_per_epoch: int, callbacks
                 ) -> tuple[dict[str, float], int]:
    """The steps of one epoch; returns its running loss and metrics, and
    the steps of it done (fewer when a callback stopped training)."""
    self.runner.start_epoch(epoch, first)
    title = f"Epoch {epoch + 1}/{epochs}" + (  # Its time counts from here.
        f" (resumed after step {first})" if first else "")
    bar = (progress_lib.EpochProgress(epoch + 1, epochs, steps_per_epoch,
                                      title=title)
           if self.o.verbose else None)
    per_call = bar is not None or bool(self.o.callbacks)
    done, total = first, self._resumed_sums(first, steps_per_epoch)
    while done < steps_per_epoch:
      if per_call:
        callbacks.on_train_batch_begin(done)
      start = time.perf_counter()
      sums = self._run_steps(done, self._call_limit(steps_per_epoch - done))
      elapsed = time.perf_counter() - start
      self._check_finite(sums, epoch)
      self.clock.add(int(sums.count), elapsed, sums.steps)
      total = self._epoch_sums = total + sums
      done += sums.steps
      self.total_steps += sums.steps
      self.global_step += sums.steps
      rate = sums.count / elapsed if elapsed else 0.0
      if per_call:
        logs = self._logs(total)
        if bar is not None:
          bar.update(done, logs, rate)
        callbacks.on_train_batch_end(done - 1, logs)
      self._write_step_summaries(sums, rate)
      stopped, preempted = self._agree(sigterm=done < steps_per_epoch)
      if stopped:  # A callback: Keras stops here too.
        break
      if done < steps_per_epoch:
        self._mid_epoch_saves(epoch, done, steps_per_epoch, preempted)
    if bar is not None:
      bar.end()
    return (self._logs(total) if total.steps else {}), done

  def _resumed_sums(self, first: int, steps_per_epoch: int) -> StepSums:
    """The sums of the epoch's first `first` steps, saved with the
    checkpoint it resumes from (none at an epoch's start)."""
    self._epoch_sums = StepSums(steps=0, loss=0.0, count=0.0)
    if not first:
      return self._epoch_sums
    text = self.o.checkpointer.epoch_sums if self.o.checkpointer else ""
    saved = StepSums.from_text(text) if text else None
    if saved is not None and saved.steps == first:
      self._epoch_sums = saved
    else:  # A checkpoint of an older tfmgpu.
      logging.info("The checkpoint holds no loss or metric sums of the "
                   "epoch's first %d steps: this epoch's figures cover its "
                   "steps %d..%d only.", first, first + 1, steps_per_epoch)
    return self._epoch_sums

  def _run_steps(self, done: int, limit: int) -> StepSums:
    """The runner's next call; TF's errors of a batch the user can fix
    said as such (`step_errors.explain`)."""
    try:
      return self.runner.run(done, limit)
    except tf.errors.InvalidArgumentError as e:
      strategy = getattr(self.runner, "strategy", None)
      better = step_errors.explain(
          e, strategy.num_replicas_in_sync if strategy else 1)
      if better is None:
        raise
      raise better from e

  def _call_limit(self, rest: int) -> int:
    """The steps the runner may run now: the `rest` of the epoch, and with
    `checkpoint_every_steps` no more whole calls than reach its next
    multiple, so that a periodic save falls where a call of
    `steps_per_execution` steps ends it (`_save_due`) however many calls
    one `run` joins (the parameter-server coordinator joined 4 per worker:
    80 steps, a 40-step epoch saved no mid-epoch checkpoint for N=5)."""
    every = self.o.checkpoint_every_steps
    if not every or self.o.checkpointer is None:
      return rest
    per_call = max(self.runner.steps_per_execution, 1)
    calls = -(-(every - self.global_step % every) // per_call)  # Ceiling.
    return min(rest, calls * per_call)

  def _agree(self, *, sigterm: bool) -> tuple[bool, bool]:
    """`(stopped, preempted)`: whether a callback set `model.stop_training`
    and (`sigterm`, with a watcher) whether SIGTERM reached a process, each
    on any worker: one all-reduce for both under multi-worker mirrored.

    A stop is then every worker's `stop_training`, so that all stop after
    the same step (a worker stopping alone crashed the others in their
    next collective). Asked of every worker as often, even where it has
    no callbacks: the chief alone may have some (a logger)."""
    stop = bool(self.o.model.stop_training)
    if sigterm and self.watcher is not None:
      preempted, stop = self.watcher.stop_requested_and(stop)
    else:
      preempted, stop = False, bool(self.o.any_worker(stop))
    self.o.model.stop_training = stop
    return stop, preempted

  # ------------------------------------------ checkpoints (reliability)

  def _mid_epoch_saves(self, epoch: int, done: int, steps_per_epoch: int,
                       preempted: bool) -> None:
    """The periodic checkpoint, then the preemption save (reusing it) when
    a worker got SIGTERM (`preempted`, agreed by `_agree`)."""
    saved = None
    if self._save_due():
      saved = self.last_checkpoint = self._save(epoch, done)
    if preempted:
      self.o.summary_writer.flush()
      saved = saved or self._save(epoch, done)
      self._preempt(epoch, done, steps_per_epoch, saved)

  def _save(self, epoch: int, epoch_step: int = 0) -> str:
    """Saves the position: `epoch` epochs and `epoch_step` steps done."""
    path = self.o.checkpointer.save(
        epoch, step=self.global_step, epoch_step=epoch_step,
        epoch_sums=self._epoch_sums.to_text() if epoch_step else "")
    self._saved_at = (self.global_step, time.monotonic())
    return path

  def _save_due(self) -> bool:
    """Whether a periodic checkpoint is due: the global step crossed a
    multiple of `checkpoint_every_steps` (the same on every worker), or
    `checkpoint_every_s` passed since the last save on any worker's clock
    (agreed by one all-reduce under multi-worker mirrored)."""
    every_steps = self.o.checkpoint_every_steps
    every_s = self.o.checkpoint_every_s
    if self.o.checkpointer is None or not (every_steps or every_s):
      return False
    last_step, last_time = self._saved_at
    if every_steps and (self.global_step // every_steps
                        > last_step // every_steps):
      return True
    if not every_s:
      return False
    due = time.monotonic() - last_time >= every_s
    return self.watcher.any_worker(due) if self.watcher else due

  # ------------------------------------------------------------------

  def _logs(self, total: StepSums) -> dict[str, float]:
    """The running loss and metrics of an epoch: the steps' losses
    weighed by their rows, as Keras reports them (a short last batch
    counts for its rows)."""
    logs = {"loss": total.mean_loss}
    logs.update(self.o.metric_results(total.metrics))
    return logs

  def _check_finite(self, sums: StepSums, epoch: int) -> None:
    if math.isfinite(sums.loss) and not sums.non_finite:
      return
    raise NonFiniteLossError(non_finite_message(
        sums, first_step=self.global_step + 1, epoch=epoch,
        last_checkpoint=self.last_checkpoint,
        has_model_dir=self.o.checkpointer is not None,
        weights=[v.path for v in self.o.model.weights
                 if v.dtype.startswith(("float", "bfloat"))
                 and not np.isfinite(np.asarray(v.numpy())).all()]))

  def _write_step_summaries(self, sums: StepSums, rate: float) -> None:
    if not self.o.writes_summaries:  # Python per call: skip without a writer.
      return
    with self.o.summary_writer.as_default(step=self.global_step):
      tf.summary.scalar("train/loss", sums.mean_loss)
      tf.summary.scalar("train/examples_per_sec", rate)

  def _preempt(self, epoch: int, epoch_step: int, steps_per_epoch: int,
               checkpoint: str | None, last: bool = False) -> None:
    self.o.summary_writer.flush()
    if self.runner.coordinator_only:
      who = "the coordinator"
    else:
      who = self.watcher.who
    raise preempted_error(
        self.o.checkpointer, checkpoint, who=who, global_step=self.global_step,
        epoch=epoch, epoch_step=epoch_step, steps_per_epoch=steps_per_epoch,
        last=last)

  def _finish_epoch(self, epoch: int, epochs: int, logs: dict[str, float],
                    callbacks, at: tuple[int, int]) -> None:
    """Validation, summaries, checkpoint, callbacks and history of an epoch
    (the checkpoint before the callbacks, which may change the model for a
    moment: `SwapEMAWeights`; a learning rate they set is recorded after).

    `at`: the position to save, `(epochs done, steps done in the next)`.
    """
    epoch_logs = dict(logs)
    if self.o.validate is not None:
      epoch_logs.update(self.o.validate())
    epoch_logs["examples_per_sec"] = self.clock.rate
    if self.o.writes_summaries:  # Else a user's TensorBoard writer took them.
      with self.o.summary_writer.as_default(step=epoch + 1):
        for k, v in epoch_logs.items():
          tf.summary.scalar(f"epoch/{k}", v)
    if self.o.checkpointer is not None:
      self.last_checkpoint = self._save(*at)
    if not self.o.verbose:
      logging.info("epoch %d/%d: %s", epoch + 1, epochs, ", ".join(
          f"{k}={v:.4g}" for k, v in epoch_logs.items()))
    callbacks.on_epoch_end(epoch, epoch_logs)  # The last one fills history.
    if self.o.checkpointer is not None:  # A rate they set resumes too.
      self.o.checkpointer.note_learning_rate(self.last_checkpoint)
