"""One training run from a `TrainConfig`: what `python -m tfmgpu.train` does.

config -> its distribution (resolved once) -> devices -> data -> model built
where the distribution puts it -> `Trainer.fit` -> test evaluation -> saved
model -> `RunSummary`. A plain function of a config, so a notebook can call
it twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import time
from typing import Any, Callable

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
from tfmgpu import models as models_lib
from tfmgpu import rundir
from tfmgpu import strategies as strategies_lib
from tfmgpu.config import TrainConfig
from tfmgpu.parallel import placed_model
from tfmgpu.placements import base as placements_base
from tfmgpu.placements import model_parallel
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import lost_tasks
from tfmgpu.training.loop import Trainer
from tfmgpu.training.loop import TrainResult
from tfmgpu.training.trainer_options import TrainerOptions


@dataclasses.dataclass
class RunSummary:
  """The outcome of `run_training`, printed by the CLI at the end.

  `final_accuracy` / `test_accuracy` are NaN for a run without an
  `accuracy` metric; `train_metrics` / `test_metrics` hold every metric the
  run reported (by the names the user gave), and the printed rows list
  them: `test loss / mae  0.0123 / 0.0871`. A dataset's baselines
  (`data.Baseline`, e.g. `stdlib_text`'s byte-unigram bits per byte) are
  printed next to the run's value of the same metric.
  """
  strategy: str
  replicas: int
  devices: list[str]
  final_loss: float
  final_accuracy: float
  test_loss: float
  test_accuracy: float
  examples_per_sec: float
  seconds: float
  model_dir: str
  checkpoint: str | None
  saved_model: str | None
  result: TrainResult = dataclasses.field(repr=False)
  model: Any = dataclasses.field(repr=False, default=None)
  plan: Any = dataclasses.field(repr=False, default=None)
  weights_digest: str = ""
  layout: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  model_name: str = ""
  dataset_name: str = ""
  train_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  test_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  baselines: tuple[data_lib.Baseline, ...] = ()
  step_seconds: float = float("nan")
  predicted_step_seconds: float | None = None
  prediction: str = ""

  def _step_rows(self) -> list[tuple[str, str]]:
    """`step time  measured 41.2 ms (median) / predicted 35.0 ms (...):
    x1.18`, for a placed layout the cost model predicts."""
    predicted, measured = self.predicted_step_seconds, self.step_seconds
    if predicted is None or not predicted > 0:
      return []
    said = f"predicted {predicted * 1e3:.1f} ms ({self.prediction})"
    if np.isnan(measured):
      return [("step time", f"{said}; not measured: only the first (tracing) "
               "call ran (give more steps than --steps_per_execution)")]
    return [("step time", f"measured {measured * 1e3:.1f} ms (median per "
             f"step, first call left out) / {said}: measured "
             f"x{measured / predicted:.2f} of predicted")]

  def _baseline_rows(self) -> list[tuple[str, str]]:
    """`test bits_per_byte  2.4000 (byte-unigram baseline 4.3700; 1.9700
    below)`, or the baseline alone when the run did not report its metric."""
    rows = []
    for b in self.baselines:
      value = self.test_metrics.get(b.metric)
      if value is None:
        rows.append((f"{b.name} baseline",
                     f"test {b.metric} {b.value:.4f} (give --metrics="
                     f"{b.metric} to compare)"))
        continue
      gap = b.value - value
      rows.append((f"test {b.metric}",
                   f"{value:.4f} ({b.name} baseline {b.value:.4f}; "
                   f"{abs(gap):.4f} {'below' if gap >= 0 else 'above'})"))
    return rows

  def _training_rows(self) -> list[tuple[str, str]]:
    if not self.result.epochs_run:
      done = self.result.initial_epoch
      return [(_label("train", self.test_metrics),
               f"not trained: {self.model_dir} already held {done} epoch(s)")]
    return [(_label("train", self.train_metrics),
             _values(self.final_loss, self.train_metrics)),
            ("throughput", f"{self.examples_per_sec:,.0f} examples/s"),
            *self._step_rows()]

  def _tensorboard_rows(self) -> list[tuple[str, str]]:
    """How to open the run's summaries, when it wrote any."""
    summaries = os.path.join(self.model_dir, "summaries")
    if not os.path.isdir(summaries):
      return []
    return [("tensorboard", f"tensorboard --logdir {shlex.quote(summaries)}")]

  def __str__(self) -> str:
    named = [(k, v) for k, v in (("model", self.model_name),
                                 ("dataset", self.dataset_name)) if v]
    rows = [("strategy", self.strategy), *named, *self.layout,
            *self._training_rows(),
            (_label("test", self.test_metrics),
             _values(self.test_loss, self.test_metrics) if self.test_metrics
             or not np.isnan(self.test_loss)
             else "none (the loader gave no test split)"),
            *self._baseline_rows(),
            ("wall time", f"{self.seconds:.1f} s"),
            ("checkpoints", self.checkpoint or "none"),
            ("saved model", self.saved_model or "none"),
            *self._tensorboard_rows(),
            ("weights sha256", self.weights_digest or "n/a")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _label(split: str, metrics: dict[str, float]) -> str:
  """`"test loss / accuracy"`: the loss, then each metric's name."""
  return " / ".join([f"{split} loss", *metrics])


def _values(loss: float, metrics: dict[str, float]) -> str:
  return " / ".join(f"{v:.4f}" for v in (loss, *metrics.values()))


def weights_digest(model: keras.Model) -> str:
  """A short SHA-256 of the model's weights: equal on every worker of a
  synchronous multi-worker job (compare the summaries the workers print)."""
  digest = hashlib.sha256()
  for w in model.get_weights():
    digest.update(np.ascontiguousarray(w).tobytes())
  return digest.hexdigest()[:16]


def describe_plan(config: TrainConfig, *, arrays: data_lib.Arrays | None = None
                  ) -> str:
  """What `--plan_only` prints: the distribution's plan (`plan_text`: the
  stage plan and its per-device memory table, a pipeline's micro-batches,
  schedule and recomputation included; for `auto`, the layouts it weighs
  and the one it chooses), else the stage plan the stage options ask for;
  without training."""
  distribution = config.distribution
  devices_lib.configure_virtual_devices(
      config.virtual_devices, intra_op_threads=distribution.intra_op_threads)
  if arrays is None:  # A streamed dataset gives its shapes without reading.
    arrays = data_lib.open_dataset(config.dataset, **config.dataset_options())
  model = placements_base.build_for_plan(lambda: models_lib.build_model(
      config.model, input_shape=arrays.input_shape,
      num_classes=arrays.num_classes, seed=config.seed,
      **config.model_options()))
  run = dict(global_batch_size=config.global_batch_size,
             optimizer=config.optimizer, input_shape=arrays.input_shape)
  text = distribution.plan_text(model, config.options, **run)
  if text is None:  # No plan of its own: the stage options' plan.
    stages = model_parallel.ModelParallel()  # Not a second registry lookup.
    options = stages.options_of(config.values_of(stages.Options))
    text = (f"strategy={config.strategy!r} has no stage plan: each replica "
            "holds the whole model. For comparison, the split "
            f"--strategy=model_parallel --num_stages={options.num_stages} "
            "would make:\n" + stages.plan_text(model, options, **run))
  return text


def start_devices(config: TrainConfig,
                  distribution: strategies_lib.Distribution, options: Any):
  """Configures the devices; returns the strategy if it had to come first.

  A strategy that joins a cluster configures collective ops when TF's
  runtime starts: the devices are split without starting it, the strategy
  is created, and only then are the devices read.
  """
  strategy = None
  if distribution.joins_cluster:
    devices_lib.split_virtual_devices(config.virtual_devices)
    strategy = distribution.make_strategy(options)
  devices_lib.configure_virtual_devices(
      config.virtual_devices, intra_op_threads=distribution.intra_op_threads)
  return strategy


def make_trainer(config: TrainConfig, placement: strategies_lib.Placement, *,
                 model_dir: str, callbacks=()) -> Trainer:
  """The Trainer for `placement` with the config's training settings, run
  as its distribution says (`Distribution.execution`)."""
  loss, metrics = config.loss_and_metrics()
  options = TrainerOptions.from_settings(
      config.values_of(TrainerOptions), loss=loss, metrics=metrics,
      model_dir=model_dir, callbacks=tuple(callbacks))
  # Every setting as a keyword argument: a run trains with its own, not a
  # compiled model's (`_warn_compile_unused`).
  return Trainer(
      placement.model, strategy=placement.strategy,
      execution=placement.distribution.execution,
      **{f.name: getattr(options, f.name)
         for f in dataclasses.fields(options)})


def _model_builder(config: TrainConfig, arrays: data_lib.Arrays,
                   model_fn: models_lib.ModelFn | None
                   ) -> Callable[[], keras.Model]:
  warned = []

  def build() -> keras.Model:
    model = models_lib.build_model(
        model_fn or config.model, input_shape=arrays.input_shape,
        num_classes=arrays.num_classes,
        mixed_precision=(None if config.mixed_precision == "float32"
                         else config.mixed_precision),
        seed=config.seed, **config.model_options())
    if getattr(model, "compiled", False) and not warned:
      warned.append(True)  # Once: autotune builds the model again.
      _warn_compile_unused(model, config)
    return model
  return build


def _warn_compile_unused(model: keras.Model, config: TrainConfig) -> None:
  """Says that a run trains with its settings, not the model's compile()."""
  loss, metrics = config.loss_and_metrics()
  logging.warning(
      "Model %r was compiled (by your build function, or by its class as "
      "keras_hub's tasks compile themselves); a run trains with its own "
      "settings, not with that compile(): optimizer=%s, learning_rate=%g, "
      "loss=%s, metrics=%s. Give them as flags (--optimizer, --loss, "
      "--metrics), or train from Python: tfmgpu.Trainer(model) takes a "
      "compiled model's optimizer, loss (per output too), loss weights and "
      "metrics.", model.name, config.optimizer, config.learning_rate,
      "sparse cross-entropy from logits (the default)" if loss is None
      else loss, metrics or ("accuracy (the default)" if loss is None
                             else "none"))


def _autotuned(config: TrainConfig, placement: strategies_lib.Placement,
               arrays: Any, build: Callable[[], keras.Model]) -> TrainConfig:
  """`config` with the options `autotune` measured fastest here (logged)."""
  from tfmgpu.training import autotune  # pylint: disable=g-import-not-at-top
  if config.is_placement or placed_model.is_placed(placement.model) or (
      not isinstance(arrays, data_lib.Arrays)) or (
          not isinstance(arrays.x_train, np.ndarray)):
    logging.info("autotune: not tuned: it times data-parallel training of "
                 "whole model copies on "
                 "in-memory arrays (this run: %s, %s).", config.strategy,
                 type(arrays).__name__)
    return config
  choice = autotune.tune_training(
      build, placement.strategy, arrays.x_train, arrays.y_train,
      global_batch_size=config.global_batch_size,
      current=autotune.Settings(**{n: getattr(config, n)
                                   for n in autotune.TUNED}),
      optimizer=config.optimizer, learning_rate=config.learning_rate,
      clip_norm=config.clip_norm, bytes_per_pack=config.bytes_per_pack,
      fused_optimizer=config.fused_optimizer)
  return config.replace(**choice.settings.as_dict())


def _training_data(config: TrainConfig, arrays: Any) -> Any:
  """The run's data: `arrays` (as a `--dataset` loader returns them: made
  `Arrays`), or `config.dataset` opened; labels and inputs checked, logged."""
  if arrays is None:
    arrays = data_lib.open_dataset(config.dataset, **config.dataset_options())
  elif isinstance(arrays, (tuple, list)):
    arrays = data_lib.user_arrays("arrays", arrays)
  logging.info("Data: %r", arrays)
  if isinstance(arrays, data_lib.Arrays):
    data_lib.check_labels(arrays)  # Before a first step fails on one.
    if config.loss is None:
      data_lib.check_labels_for_default_loss(arrays)
    data_lib.check_features(arrays)
    data_lib.check_shapes(arrays)
  return arrays


def run_training(config: TrainConfig, *,
                 model_fn: models_lib.ModelFn | None = None,
                 arrays: "data_lib.Arrays | data_lib.StreamedDataset | tuple "
                 "| None" = None,
                 callbacks=()) -> RunSummary:
  """Runs one training job end to end.

  Args:
    config: the run.
    model_fn: build this instead of `config.model`.
    arrays: train on these instead of loading `config.dataset`: `Arrays`,
      `((x_train, y_train), (x_test, y_test))` (as a `--dataset` loader
      returns them), or a `data.StreamedDataset` (e.g.
      `tfrecord.open_source(...)`).
    callbacks: Keras callbacks for the loop.

  Returns:
    A `RunSummary` (printable) with the trained model.

  Raises:
    tfmgpu.training.checkpoints.PreemptedError: SIGTERM during training; a
      checkpoint was saved in `model_dir` and a new call resumes from it.
  """
  start = time.perf_counter()
  # Resolved once, when the config was made, for the whole run.
  distribution, options = config.distribution, config.options
  strategy = start_devices(config, distribution, options)
  arrays = _training_data(config, arrays)
  build = _model_builder(config, arrays, model_fn)
  placement = distribution.place(options, build, strategy=strategy,
                                 seed=config.seed)
  placement.distribution = placement.distribution or distribution
  placement.options = placement.options or options
  if placement.plan is not None:
    print(placement.plan, flush=True)
  if config.autotune:
    config = _autotuned(config, placement, arrays, build)
  model_dir = config.model_dir or rundir.default_model_dir(config.strategy)
  trainer = make_trainer(config, placement, model_dir=model_dir,
                         callbacks=callbacks)
  try:
    result, test = _fit_and_test(trainer, config, arrays)
    saved = None
    if ckpt_lib.is_chief(placement.strategy):
      saved = placement.distribution.save_model(
          placement.model, os.path.join(model_dir, "model.keras"))
  finally:
    trainer.close()
  return _summary(config, placement, result, test, model_dir=model_dir,
                  checkpoint=result.checkpoint or (
                      trainer.checkpointer.latest if trainer.checkpointer
                      else None),
                  saved=saved, seconds=time.perf_counter() - start,
                  names=(getattr(model_fn, "__name__", None) or config.model,
                         getattr(arrays, "name", None) or config.dataset),
                  baselines=getattr(arrays, "baselines", ()))


def _fit_and_test(trainer: Trainer, config: TrainConfig,
                  data: "data_lib.Arrays | data_lib.StreamedDataset | "
                  "data_lib.UserDatasets"
                  ) -> tuple[TrainResult, dict[str, float]]:
  """`_fit_and_test_once`; a damaged file of a streamed dataset is named
  (one that fails its checksums, is read short or long, or is deleted),
  and so is a task of the cluster that was lost (`lost_tasks`)."""
  try:
    return _fit_and_test_once(trainer, config, data)
  except (tf.errors.DataLossError, tf.errors.FailedPreconditionError,
          tf.errors.NotFoundError) as e:
    if isinstance(data, (data_lib.Arrays, data_lib.UserDatasets)):
      raise  # Nothing to explain it by (a user's dataset has no method).
    raise data.explain_read_error(e) from None
  except tf.errors.UnavailableError as e:
    if not config.distribution.joins_cluster:
      raise
    raise lost_tasks.lost_task_error(e.message, trainer.checkpointer) from e


def _fit_and_test_once(trainer: Trainer, config: TrainConfig,
                       data: "data_lib.Arrays | data_lib.StreamedDataset | "
                       "data_lib.UserDatasets"
                       ) -> tuple[TrainResult, dict[str, float]]:
  """Trains, then evaluates on the test split: in-memory arrays, a
  streamed dataset's dataset functions (read from its files as they train),
  or a user loader's `tf.data` datasets (no test split: a NaN loss)."""
  batch = config.global_batch_size
  if isinstance(data, data_lib.UserDatasets):  # The dataset sets the batch.
    result = trainer.fit(data.train, epochs=config.epochs,
                         steps_per_epoch=config.steps_per_epoch)
    return result, (trainer.evaluate(data.test) if data.test is not None
                    else {"loss": float("nan")})  # No test split given.
  if isinstance(data, data_lib.Arrays):
    result = trainer.fit(
        data.x_train, data.y_train, epochs=config.epochs,
        global_batch_size=batch, steps_per_epoch=config.steps_per_epoch,
        seed=config.seed)
    return result, trainer.evaluate(data.x_test, data.y_test,
                                    global_batch_size=batch)
  stream = data.train_dataset_fn(  # Workers that stream on their own.
      batch, independent_workers=trainer.execution.streams)
  test = data.test_dataset_fn(batch)  # Before training: it checks the files.
  result = trainer.fit(stream, epochs=config.epochs, steps_per_epoch=(
      config.steps_per_epoch or data.steps_per_epoch(batch)))
  return result, trainer.evaluate(test)


def _summary(config: TrainConfig, placement: strategies_lib.Placement,
             result: TrainResult, test: dict[str, float], *, model_dir: str,
             checkpoint: str | None, saved: str | None,
             seconds: float, names: tuple[str, str],
             baselines: tuple[data_lib.Baseline, ...] = ()) -> RunSummary:
  """The summary; `names`: the model's and the dataset's, as the user
  named them (a registry name or a `module:function` reference);
  `baselines`: the dataset's, printed next to the run's values."""
  history = result.history
  nan = float("nan")
  test_metrics = {k: v for k, v in test.items() if k not in ("loss", "count")}
  no_test = not test_metrics and np.isnan(test["loss"])  # No test split.
  trained = test_metrics if not no_test else [
      k for k in history if k not in ("loss", "examples_per_sec")
      and not k.startswith("val_")]
  train_metrics = {k: history[k][-1] if history.get(k) else nan
                   for k in trained}
  chosen = placement.distribution.name  # `auto` names what it chose.
  predicted, words = predicted_step(placement, config)
  return RunSummary(
      strategy=(config.strategy if chosen == config.strategy
                else f"{config.strategy}: {chosen}"),
      replicas=config.distribution.replicas(placement),
      devices=placement.devices,
      final_loss=history["loss"][-1] if history else nan,
      final_accuracy=train_metrics.get("accuracy", nan),
      test_loss=test["loss"], test_accuracy=test_metrics.get("accuracy", nan),
      train_metrics=train_metrics, test_metrics=test_metrics,
      model_name=names[0], dataset_name=names[1], baselines=tuple(baselines),
      examples_per_sec=result.examples_per_sec, seconds=seconds,
      model_dir=model_dir, checkpoint=checkpoint, saved_model=saved,
      result=result, model=placement.model, plan=placement.plan,
      weights_digest=weights_digest(placement.model),
      layout=placement.distribution.describe(placement),
      step_seconds=result.step_seconds, predicted_step_seconds=predicted,
      prediction=words)


def predicted_step(placement: strategies_lib.Placement, config: TrainConfig
                   ) -> tuple[float | None, str]:
  """The cost model's step of a placed layout (`placement.costs`) on its
  devices as `tfmgpu.parallel.calibration` measured them (cached per host),
  and where it comes from; `(None, "")` for other placements."""
  if placement.costs is None:
    return None, ""
  from tfmgpu.parallel import calibration  # pylint: disable=g-import-not-at-top
  try:  # A trained run never fails for want of its prediction.
    found = calibration.calibrate(placement.devices)
    account = placement.costs.account(
        global_batch_size=config.global_batch_size,
        optimizer=config.optimizer)
    step = account.step(found.hardware(len(placement.devices)))
  except Exception as e:  # pylint: disable=broad-except
    # Any error: the prediction is a figure beside a finished run.
    logging.warning("No predicted step in the summary (%s: %s).",
                    type(e).__name__, e)
    return None, ""
  return step.total_s, f"cost model calibrated: {found.words()}"


def save_model(model: keras.Model, path: str,
               distribution: strategies_lib.Distribution | None = None) -> str:
  """Saves servable `.keras` file(s) as `distribution` does (default: the
  plain model); returns what to pass to `--model_path`.

  A placed model is saved unsplit; branch-parallel members one file each
  (`model.branch0.keras`, ...). Each file is written aside and renamed
  into place, so an existing file is replaced whole or not at all.
  """
  return (distribution or strategies_lib.Distribution()).save_model(model,
                                                                    path)
