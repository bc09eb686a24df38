"""One training run from a `TrainConfig`: what `python -m tfmgpu.train` does.

devices -> strategy (or stage placement) -> data -> model built where it
belongs -> `Trainer.fit` -> test evaluation -> saved model -> `RunSummary`.
A plain function of a config, so a notebook can call it twice.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import time
from typing import Any, Callable

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu.config import TrainConfig
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import parameter_server as ps_lib
from tfmgpu.training.loop import Trainer
from tfmgpu.training.loop import TrainResult


@dataclasses.dataclass
class RunSummary:
  """The outcome of `run_training`, printed by the CLI at the end."""
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

  def _layout_row(self) -> tuple[str, str]:
    on = ", ".join(self.devices)
    if self.plan is not None:
      return ("stages", f"{len(self.devices)} on {on}")
    if self.strategy == "branch_parallel":
      return ("branches", f"{len(self.devices)} on {on}")
    return ("replicas", f"{self.replicas} on {on}")

  def __str__(self) -> str:
    rows = [
        ("strategy", self.strategy),
        self._layout_row(),
        ("train loss / accuracy",
         f"{self.final_loss:.4f} / {self.final_accuracy:.4f}"),
        ("test loss / accuracy", f"{self.test_loss:.4f} / {self.test_accuracy:.4f}"),
        ("throughput", f"{self.examples_per_sec:,.0f} examples/s"),
        ("wall time", f"{self.seconds:.1f} s"),
        ("checkpoints", self.checkpoint or "none"),
        ("saved model", self.saved_model or "none"),
        ("weights sha256", self.weights_digest or "n/a"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def short_device(name: str) -> str:
  """'/job:localhost/replica:0/task:0/device:CPU:1' -> '/device:CPU:1'."""
  return name.replace("/job:localhost/replica:0/task:0", "")


def weights_digest(model: keras.Model) -> str:
  """A short SHA-256 of the model's weights: equal on every worker of a
  synchronous multi-worker job (compare the summaries the workers print)."""
  digest = hashlib.sha256()
  for w in model.get_weights():
    digest.update(np.ascontiguousarray(w).tobytes())
  return digest.hexdigest()[:16]


def default_model_dir(strategy: str) -> str:
  """A fresh run directory, `runs/<time>-<strategy>` (never resumes by accident)."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
  return os.path.join("runs", f"{stamp}-{strategy}")


@dataclasses.dataclass
class Placement:
  """Where a run's model lives: its strategy, devices and the built model."""
  strategy: tf.distribute.Strategy
  devices: list[str]
  model: keras.Model
  plan: Any = None


def _replicated(config: TrainConfig, build: Callable[[], keras.Model],
                strategy: tf.distribute.Strategy | None = None) -> Placement:
  """Data parallelism: the whole model built in the strategy's scope."""
  strategy = strategy or strategies_lib.get_strategy(
      config.strategy, **config.strategy_options())
  with strategy.scope():
    model = build()
  return Placement(strategy, replica_devices(strategy), model)


def replica_devices(strategy: tf.distribute.Strategy) -> list[str]:
  """The devices a strategy's replicas run on, short names."""
  try:
    devices = list(strategy.extended.worker_devices)
  except (AttributeError, RuntimeError):  # The default strategy has none.
    devices = []
  return [short_device(d) for d in devices] or [
      devices_lib.accelerator_devices()[0]]


def _build_unsplit(build: Callable[[], keras.Model]) -> keras.Model:
  # The whole model exists once on the host, then each stage is rebuilt on
  # its own device; building it on GPU:0 would defeat the split.
  with tf.device("/cpu:0"):
    return build()


def plan_for(config: TrainConfig, model: keras.Model):
  """The `StagePlan` that `config` asks for (num_stages, partition, split)."""
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  split = list(config.split_points) if config.split_points else None
  stages = len(split) + 1 if split else config.num_stages
  return partition.plan_stages(model, stages, criterion=config.partition,
                               split_points=split)


def _staged(config: TrainConfig, build: Callable[[], keras.Model]) -> Placement:
  from tfmgpu.parallel import staged  # pylint: disable=g-import-not-at-top
  model = _build_unsplit(build)
  plan = plan_for(config, model)
  return Placement(tf.distribute.get_strategy(), list(plan.devices),
                   staged.StagedModel(model, plan), plan)


def _pipelined(config: TrainConfig, build: Callable[[], keras.Model]
               ) -> Placement:
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  if config.global_batch_size % config.micro_batches:
    raise ValueError(
        f"global_batch_size={config.global_batch_size} is not divisible by "
        f"micro_batches={config.micro_batches}. Use a multiple of "
        f"{config.micro_batches}.")
  model = _build_unsplit(build)
  plan = plan_for(config, model)
  return Placement(tf.distribute.get_strategy(), list(plan.devices),
                   pipeline.PipelinedModel(
                       model, plan, micro_batches=config.micro_batches,
                       schedule=config.schedule, recompute=config.recompute),
                   plan)


def _branches(config: TrainConfig, build: Callable[[], keras.Model]
              ) -> Placement:
  """`num_stages` independently initialised members, averaged (an ensemble)."""
  from tfmgpu.parallel import branches  # pylint: disable=g-import-not-at-top
  devices = devices_lib.accelerator_devices()
  if config.num_stages > len(devices):
    raise ValueError(
        f"branch_parallel with num_stages={config.num_stages} needs one device "
        f"per branch but only {len(devices)} exist ({', '.join(devices)}). "
        "Use --virtual_devices or fewer branches.")
  members = []
  for i in range(config.num_stages):
    keras.utils.set_random_seed(config.seed + i)
    members.append(_build_unsplit(build))
  model = branches.BranchParallel(members, devices=devices[:config.num_stages],
                                  combine="mean")
  return Placement(tf.distribute.get_strategy(), devices[:config.num_stages],
                   model)


# How each placement name builds its model: the registry of strategies says
# which names exist; this says how to train them.
PLACEMENT_BUILDERS: dict[str, Callable[[TrainConfig, Callable[[], keras.Model]],
                                       Placement]] = {
    "model_parallel": _staged,
    "pipeline": _pipelined,
    "branch_parallel": _branches,
}


def place_model(config: TrainConfig, build: Callable[[], keras.Model], *,
                strategy: tf.distribute.Strategy | None = None) -> Placement:
  """Builds the model where `config.strategy` puts it (in `strategy` if given)."""
  if not config.is_placement:
    return _replicated(config, build, strategy)
  if config.strategy not in PLACEMENT_BUILDERS:
    raise ValueError(f"strategy {config.strategy!r} has no training placement "
                     f"yet. Available: {', '.join(PLACEMENT_BUILDERS)}.")
  return PLACEMENT_BUILDERS[config.strategy](config, build)


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def describe_plan(config: TrainConfig, *, arrays: data_lib.Arrays | None = None
                  ) -> str:
  """The stage plan and per-device memory estimate, without training."""
  devices_lib.configure_virtual_devices(
      config.virtual_devices,
      intra_op_threads=strategies_lib.intra_op_threads_for(config.strategy))
  if arrays is None:
    arrays = data_lib.load_dataset(config.dataset, **config.dataset_options())
  model = _build_unsplit(lambda: models_lib.build_model(
      config.model, input_shape=arrays.input_shape,
      num_classes=arrays.num_classes, seed=config.seed))
  plan = plan_for(config, model)
  per_replica = config.global_batch_size
  lines = [str(plan), "",
           f"Estimated memory per device (batch {per_replica}, "
           f"{config.optimizer} slots):"]
  for device, est in plan.memory_estimate(
      per_replica, optimizer=config.optimizer).items():
    lines.append(
        f"  {device}: {_mib(est.total)} total = weights {_mib(est.weights)} "
        f"+ gradients {_mib(est.gradients)} + optimizer slots "
        f"{_mib(est.optimizer_slots)} + activations {_mib(est.activations)}")
  return "\n".join(lines)


def run_training(config: TrainConfig, *,
                 model_fn: models_lib.ModelFn | None = None,
                 arrays: data_lib.Arrays | None = None,
                 callbacks=()) -> RunSummary:
  """Runs one training job end to end.

  Args:
    config: the run.
    model_fn: build this instead of `config.model`.
    arrays: train on these instead of loading `config.dataset`.
    callbacks: Keras callbacks for the loop.

  Returns:
    A `RunSummary` (printable) with the trained model.

  Raises:
    tfmgpu.training.checkpoints.PreemptedError: SIGTERM during training; a
      checkpoint was saved in `model_dir` and a new call resumes from it.
  """
  start = time.perf_counter()
  strategy = None
  if strategies_lib.strategy_entry(config.strategy).joins_cluster:
    # Collective ops and the cluster are configured when TF's runtime starts:
    # split the devices without starting it, create the strategy, then look.
    devices_lib.split_virtual_devices(config.virtual_devices)
    strategy = strategies_lib.get_strategy(config.strategy,
                                           **config.strategy_options())
  layout = devices_lib.configure_virtual_devices(
      config.virtual_devices,
      intra_op_threads=strategies_lib.intra_op_threads_for(config.strategy))
  if (config.strategy == "mirrored" and not layout.gpus
      and len(layout.cpus) == 1):
    logging.warning(
        "No GPU found: 'mirrored' trains one replica on the CPU. To simulate "
        "N devices, add --virtual_devices=N (Python: "
        "tfmgpu.configure_devices(logical_cpus=N) before any TF work).")
  if arrays is None:
    arrays = data_lib.load_dataset(config.dataset, **config.dataset_options())
  logging.info("Data: %r", arrays)

  def build() -> keras.Model:
    return models_lib.build_model(
        model_fn or config.model, input_shape=arrays.input_shape,
        num_classes=arrays.num_classes,
        mixed_precision=(None if config.mixed_precision == "float32"
                         else config.mixed_precision),
        seed=config.seed)

  placement = place_model(config, build, strategy=strategy)
  if placement.plan is not None:
    print(placement.plan, flush=True)
  model_dir = config.model_dir or default_model_dir(config.strategy)
  trainer_class = (ps_lib.ParameterServerTrainer
                   if ps_lib.is_parameter_server(placement.strategy)
                   else Trainer)
  trainer = trainer_class(
      placement.model, strategy=placement.strategy, optimizer=config.optimizer,
      learning_rate=config.learning_rate, clip_norm=config.clip_norm,
      gradient_compression=config.gradient_compression,
      bytes_per_pack=config.bytes_per_pack,
      steps_per_execution=config.steps_per_execution,
      jit_compile=config.jit_compile,
      fused_optimizer=config.fused_optimizer, input_mode=config.input_mode,
      model_dir=model_dir,
      callbacks=callbacks, verbose=config.verbose)
  try:
    result = trainer.fit(
        arrays.x_train, arrays.y_train, epochs=config.epochs,
        global_batch_size=config.global_batch_size,
        steps_per_epoch=config.steps_per_epoch, seed=config.seed)
    test = trainer.evaluate(arrays.x_test, arrays.y_test,
                            global_batch_size=config.global_batch_size)
    saved = None
    if ckpt_lib.is_chief(placement.strategy):
      saved = save_model(placement.model, os.path.join(model_dir, "model.keras"))
  finally:
    trainer.close()
  history = result.history
  return RunSummary(
      strategy=config.strategy, replicas=placement.strategy.num_replicas_in_sync,
      devices=placement.devices,
      final_loss=history["loss"][-1] if history else float("nan"),
      final_accuracy=history["accuracy"][-1] if history else float("nan"),
      test_loss=test["loss"], test_accuracy=test["accuracy"],
      examples_per_sec=result.examples_per_sec,
      seconds=time.perf_counter() - start, model_dir=model_dir,
      checkpoint=result.checkpoint or (trainer._checkpointer.latest  # pylint: disable=protected-access
                                       if trainer._checkpointer else None),  # pylint: disable=protected-access
      saved_model=saved, result=result, model=placement.model,
      plan=placement.plan, weights_digest=weights_digest(placement.model))


def save_model(model: keras.Model, path: str) -> str:
  """Saves servable `.keras` file(s); returns what to pass to `--model_path`.

  A staged or pipelined model is saved unsplit. Branch-parallel members are
  saved one file each (`model.branch0.keras`, ...), which
  `python -m tfmgpu.predict --strategy=branch_parallel --model_path=a,b`
  serves side by side.
  """
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  branches = getattr(model, "branches", None)
  if branches is not None:
    stem = path[:-len(".keras")] if path.endswith(".keras") else path
    paths = [f"{stem}.branch{i}.keras" for i in range(len(branches))]
    for branch, branch_path in zip(branches, paths):
      branch.save(branch_path)
    return ",".join(paths)
  to_unsplit = getattr(model, "to_unsplit", None)
  servable = to_unsplit() if to_unsplit is not None else model
  servable.save(path)
  return path
