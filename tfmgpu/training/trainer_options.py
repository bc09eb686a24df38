"""What a `Trainer` does besides its model and strategy: one frozen value.

`TrainerOptions` gathers the optimizer, objective, execution and output
settings that `tfmgpu.Trainer(...)` takes as keyword arguments (it builds
one from them), so a run hands them over once
(`TrainerOptions.from_settings(config.values_of(TrainerOptions), ...)`)
instead of re-threading each.
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
  """A `Trainer`'s settings. Every field has a working default.

  Attributes:
    optimizer: a name (see `OPTIMIZER_CHOICES`) or a Keras optimizer.
      Defaults to `"adam"`. Float16 models get a `LossScaleOptimizer`.
    learning_rate: used with an optimizer name, and by a compiled model's
      own optimizer (which the Trainer takes when `optimizer` is not
      given). Refused next to an optimizer object with another rate.
      Defaults to `1e-3`.
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
    batch_splits: cut each replica's batch into this many row slices whose
      forwards and backwards run side by side, their gradients summed
      (`tfmgpu.training.batch_splits`): the cores of a CPU stay busier.
      Equal to the unsplit step up to float rounding; refused for models
      with BatchNormalization or losses of their own. Defaults to `1`.
    fused_optimizer: when `optimizer` is a name, update each variable with
      one fused kernel (`tfmgpu.training.fused`); an optimizer object is
      used as given. Given to a compiled model's Trainer, it trains a
      fused copy of the compiled optimizer, with all its settings.
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
    zero_stage: shard the model's state over the replicas' devices (ZeRO,
      `tfmgpu.parallel.zero`): `1` the optimizer slots, `2` and the
      gradients, `3` and the weights. Defaults to `0` (whole copies).

  Raises:
    ValueError: `steps_per_execution < 1`.
  """
  optimizer: Any = "adam"
  learning_rate: float = 1e-3
  clip_norm: float | None = None
  gradient_compression: str = "none"
  bytes_per_pack: int = 0
  loss: Any = None
  metrics: Any = None
  loss_weights: Any = None
  weighted_metrics: Any = None
  steps_per_execution: int = 1
  jit_compile: bool = False
  batch_splits: int = 1
  fused_optimizer: bool = True
  input_mode: str = "auto"
  model_dir: str | None = None
  checkpoint_every_steps: int | None = None
  checkpoint_every_s: float | None = None
  callbacks: Sequence[Any] = ()
  verbose: int = 1
  zero_stage: int = 0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      kind = field.type.split(" |")[0]
      if isinstance(value, str) and kind in ("int", "float", "bool"):
        example = (f", e.g. {field.name}={field.default!r}"
                   if field.default is not None else "")
        raise ValueError(
            f"{field.name}={value!r} is a string; pass "
            f"{'True or False' if kind == 'bool' else 'a number'}{example}.")
    if self.steps_per_execution < 1:
      raise ValueError(
          f"steps_per_execution={self.steps_per_execution} must be >= 1.")
    object.__setattr__(self, "callbacks", tuple(self.callbacks))
    _refuse_backup_and_restore(self.callbacks)

  @classmethod
  def from_settings(cls, settings: Mapping[str, Any], **overrides: Any
                    ) -> "TrainerOptions":
    """The options a run's settings name (`settings`: values by name, e.g.
    a config's `values_of(TrainerOptions)`; other names are not taken),
    `overrides` applied last."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in settings.items() if k in names}
    values.update(overrides)
    return cls(**values)

  @classmethod
  def of(cls, options: "TrainerOptions | None", settings: dict[str, Any]
         ) -> "TrainerOptions":
    """`options` (default ones if `None`) with `settings` (keyword
    arguments of `Trainer`) applied.

    Raises:
      TypeError: a setting that is not a field, naming the fields.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
      raise TypeError(f"Trainer got unknown argument(s) {', '.join(unknown)}."
                      f" Besides model, strategy, options and execution it takes the "
                      f"TrainerOptions fields: {', '.join(names)}.")
    return dataclasses.replace(options or cls(), **settings)


def _refuse_backup_and_restore(callbacks: Sequence[Any]) -> None:
  """Keras' `BackupAndRestore` restores `model`'s weights and
  `model.optimizer` and tells Keras' `fit` the epoch to go on from; the
  Trainer trains with its own optimizer and loop, so it would restore the
  weights alone and train the restored epochs again (6 epochs for 4).

  Raises:
    ValueError: naming the callback and what does the job here.
  """
  import keras  # pylint: disable=g-import-not-at-top
  for callback in callbacks:
    if isinstance(callback, keras.callbacks.BackupAndRestore):
      raise ValueError(
          "callbacks holds keras.callbacks.BackupAndRestore, which works "
          "with Keras' model.fit: under the Trainer it would restore the "
          "weights but not the Trainer's optimizer state, step or epoch, and "
          "the restored epochs would train again. Pass model_dir=... instead "
          "(CLI: --model_dir): the Trainer checkpoints there and a rerun "
          "resumes exactly where it stopped (weights, optimizer, step, "
          "epoch), also after a preemption (SIGTERM).")

