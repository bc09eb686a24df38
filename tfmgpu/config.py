"""What a run is: frozen, validated dataclasses.

The CLI turns flags into a `TrainConfig` once; notebooks build one with
keyword arguments. Validation happens here, in `__post_init__`, so both
paths get the same clear errors. Importing this module does not import
TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmgpu import checks
from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib
from tfmgpu import user_code
from tfmgpu.parallel import links
from tfmgpu.placements import model_parallel
from tfmgpu.placements import pipeline
from tfmgpu.training.choices import COMPRESSION_CHOICES
from tfmgpu.training.choices import INPUT_MODE_CHOICES
from tfmgpu.training.optimizers import OPTIMIZER_CHOICES

# How a loss or metric function named by reference is called.
_OBJECTIVE_CALL = user_code.Call(args=(0, 0), shown="fn(y_true, y_pred)")


class ConfigRuleError(ValueError):
  """Settings that are each valid but break a rule together (e.g. a global
  batch that the pipeline's micro-batches do not divide)."""


# Options of distributions other than the run's are checked too, so a typo
# never waits for the strategy that reads it.
DEFAULT_DATASET = "digits"  # For models that name no dataset of their own.

_STRATEGY_CHOICES = {
    "cross_device_ops": strategies_lib.CROSS_DEVICE_OPS_CHOICES,
    "single_replica": strategies_lib.SINGLE_REPLICA_CHOICES,
    "communication": strategies_lib.COMMUNICATION_CHOICES,
    "cluster_resolver": tuple(strategies_lib.CLUSTER_RESOLVERS),
    "partition": model_parallel.PARTITION_CHOICES,
    "schedule": pipeline.SCHEDULE_CHOICES,
    "link": links.LINK_CHOICES,
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run. Every field has a working default.

  Attributes:
    strategy: a registered name (`tfmgpu.available_strategies()`).
    virtual_devices: split the accelerator (GPU, else CPU) into this many
      logical devices first; `None` leaves devices alone.
    devices: explicit replica devices, e.g. `("/cpu:0", "/cpu:1")`.
    num_gpus: use the first N GPUs.
    num_replicas: use the first N accelerator devices.
    cross_device_ops: `auto`, `nccl`, `hierarchical_copy`, `reduction_to_one`.
    num_packs: gradient packs for all-reduce.
    single_replica: `mirrored` with one replica on the default device uses
      the `default` strategy (no wrapping overhead), or stays `mirrored`.
    communication: multi-worker collectives: `auto`, `ring`, `nccl`.
    cluster_resolver: `tf_config` or `slurm`.
    variable_shards: `parameter_server`: split each variable over this many
      parameter servers.
    connect_timeout_s: `parameter_server`: how long the coordinator waits
      for the ps and worker tasks to listen (`None`: 300 s).
    parameter_device: `central_storage`: where the variables live.
    tpu: `tpu`: the TPU's name or address (`""`: this VM's).
    model: a registered model name, or your builder as
      `"package.module:function"` / `"path/to/file.py:function"`, called as
      `function(input_shape, num_classes) -> keras.Model` (see
      `tfmgpu.models.registry`).
    model_size: a named size of a model that has them (`gpt`: `tiny` ..
      `gpt2_xl`), passed to its builder as `size=`; `None`: its default.
    model_preset: a local keras_hub preset directory a keras_hub model
      (`gpt2`, `llama`, ...) loads its architecture and weights from
      (`preset=`; nothing is downloaded); `None`: built from `model_size`.
    dataset: a registered dataset name (`data_path` for `npz`, a glob of
      TFRecord shards for `tfrecord`, or a local copy of a downloadable
      one), or your loader as a reference like `model`, returning
      `((x_train, y_train), (x_test, y_test))` (see `data.user_arrays`).
      `None`: the model's own dataset (`gpt`: `stdlib_text`, windows of
      its size's context), else `digits`.
    loss: a Keras loss name (e.g. `"mse"`) or your `fn(y_true, y_pred)` as
      a reference; `None`: sparse categorical cross-entropy from logits.
    metrics: Keras metric names (e.g. `("mae",)`), `bits_per_byte`,
      `perplexity`, or references to `fn(y_true, y_pred)`; `None`: the
      dataset's default metrics with the default loss (`accuracy`;
      `stdlib_text`: `bits_per_byte`, `perplexity`, `accuracy`), none with
      another loss.
    global_batch_size: examples per step over all replicas.
    epochs, steps_per_epoch: how long (`None`: one pass per epoch).
    optimizer, learning_rate, clip_norm: the update (the clip applies to
      the all-reduced gradient).
    gradient_compression: all-reduce gradients in `float16`/`bfloat16`.
    bytes_per_pack: all-reduce pack size (0: TF's default).
    mixed_precision: `float32`, `mixed_float16` or `mixed_bfloat16`.
    steps_per_execution: steps per `tf.function` call.
    jit_compile: XLA-compile each replica's forward/backward.
    fused_optimizer: update each variable with one fused kernel (Adam,
      AdamW, SGD/momentum; same math as Keras).
    input_mode: `auto`, `device` (training arrays held on each replica's
      device, batches gathered there) or `tf_data`.
    autotune: before training, time short runs of `input_mode`,
      `steps_per_execution`, `jit_compile` and `gradient_compression` and
      train with the fastest (`tfmgpu.training.autotune`; cached per
      machine, model and replica count; one-host data-parallel runs only).
    model_dir: checkpoints, summaries and the saved model; an existing one
      is resumed. `None`: a new directory under `runs/`.
    checkpoint_every_steps, checkpoint_every_s: also save a checkpoint
      every N global steps / every N seconds, not only per epoch (`None`:
      per epoch only).
    seed: weights and data order.
    skip_damaged_shards: `tfrecord`: read every shard through before
      training and leave out the damaged ones, logged (off: a damaged shard
      stops the run, naming it).
    num_stages, partition, split_points: model/pipeline parallelism.
    micro_batches, schedule, recompute: pipeline parallelism.
    data_parallel, tensor_parallel, tensor_rules: hybrid layouts: data-
      parallel copies of the stages, and the devices (and rules) each split
      layer is sharded over (`tfmgpu.parallel.hybrid`).
    device_memory_gb, link: what `auto` plans for: the memory budget per
      device in GB (`None`: 16) and the named link between devices
      (`tfmgpu.parallel.links`; `auto`: pcie4 between GPUs, cpu between
      logical CPUs).
    verbose: 1 for a progress line (plain off a terminal), 0 for one log
      line per epoch.
  """
  strategy: str = "mirrored"
  virtual_devices: int | None = None
  devices: tuple[str, ...] | None = None
  num_gpus: int | None = None
  num_replicas: int | None = None
  cross_device_ops: str = "auto"
  num_packs: int = 1
  single_replica: str = "default"
  communication: str = "auto"
  cluster_resolver: str = "tf_config"
  variable_shards: int | None = None
  connect_timeout_s: float | None = None
  parameter_device: str | None = None
  tpu: str = ""
  model: str = "convnet"
  model_size: str | None = None
  model_preset: str | None = None
  dataset: str | None = None
  data_path: str | None = None
  loss: str | None = None
  metrics: tuple[str, ...] | None = None
  global_batch_size: int = 64
  epochs: int = 5
  steps_per_epoch: int | None = None
  optimizer: str = "adam"
  learning_rate: float = 2e-3
  clip_norm: float | None = None
  gradient_compression: str = "none"
  bytes_per_pack: int = 0
  mixed_precision: str = "float32"
  steps_per_execution: int = 10
  jit_compile: bool = False
  fused_optimizer: bool = True
  input_mode: str = "auto"
  autotune: bool = False
  model_dir: str | None = None
  checkpoint_every_steps: int | None = None
  checkpoint_every_s: float | None = None
  seed: int = 0
  skip_damaged_shards: bool = False
  num_stages: int = 2
  partition: str = "balanced"
  split_points: tuple[str, ...] | None = None
  micro_batches: int = 4
  schedule: str = "gpipe"
  recompute: bool = False
  data_parallel: int = 1
  tensor_parallel: int = 1
  tensor_rules: str | None = None
  device_memory_gb: float | None = None
  link: str = "auto"
  verbose: int = 1

  def __post_init__(self):
    if isinstance(self.metrics, str):  # "mae,mse", as the flag takes it.
      object.__setattr__(self, "metrics", tuple(
          m.strip() for m in self.metrics.split(",") if m.strip()))
    for name in ("devices", "split_points", "metrics"):
      if getattr(self, name) is not None:  # Lists from notebooks are fine.
        object.__setattr__(self, name, tuple(getattr(self, name)))
    distribution = strategies_lib.lookup(self.strategy)
    object.__setattr__(self, "strategy", distribution.name)  # Any case in.
    models_lib.check_model(self.model)  # The user's code: found, not run.
    models_lib.check_model_size(self.model, self.model_size)
    if self.model_preset is not None:
      models_lib.hub.check_preset(self.model, self.model_preset)
    if self.model_size is None:  # Named, so a resume compares like with like.
      object.__setattr__(self, "model_size",
                         models_lib.default_size(self.model))
    if self.dataset is None:  # The model's own (gpt: stdlib_text), or digits.
      object.__setattr__(self, "dataset", models_lib.default_dataset(
          self.model, DEFAULT_DATASET))
    data_lib.check_dataset(self.dataset)
    self._check_objective()
    checks.check_choice("optimizer", self.optimizer, OPTIMIZER_CHOICES)
    checks.check_choice("mixed_precision", self.mixed_precision,
                        models_lib.MIXED_PRECISION_POLICIES)
    checks.check_choice("gradient_compression", self.gradient_compression,
                        COMPRESSION_CHOICES)
    checks.check_choice("input_mode", self.input_mode, INPUT_MODE_CHOICES)
    for name, choices in _STRATEGY_CHOICES.items():
      checks.check_choice(name, getattr(self, name), choices)
    self._check_numbers()
    self._check_layout_sizes(distribution)
    # The run's distribution checks its options and cross-field rules.
    distribution.options_from(self)
    try:
      distribution.check_config(self)
    except ValueError as e:
      raise ConfigRuleError(str(e)) from None
    if self.dataset == "npz" and not self.data_path:
      raise ValueError("dataset='npz' needs data_path='file.npz'.")
    if self.dataset == "tfrecord" and not self.data_path:
      raise ValueError("dataset='tfrecord' needs data_path='DIR/*.tfrecord' "
                       "(shards written by scripts/write_tfrecords.py).")
    if self.skip_damaged_shards and self.dataset != "tfrecord":
      raise ValueError(f"skip_damaged_shards=True applies to dataset="
                       f"'tfrecord' only, not dataset={self.dataset!r}.")

  def _check_layout_sizes(self, distribution: Any) -> None:
    """`data_parallel` / `tensor_parallel` / `tensor_rules` given to a
    strategy that does not take them: an error, not silently ignored."""
    takes = {f.name for f in dataclasses.fields(distribution.Options)}
    for name, unset in (("data_parallel", 1), ("tensor_parallel", 1),
                        ("tensor_rules", None)):
      value = getattr(self, name)
      if value != unset and name not in takes:
        users = [d.name for d in strategies_lib.registered().values()
                 if name in {f.name for f in dataclasses.fields(d.Options)}]
        raise ValueError(
            f"{name}={value!r} is not an option of strategy="
            f"{self.strategy!r}; it shapes the layouts of "
            f"{', '.join(users)} (e.g. --strategy=pipeline --num_stages=2 "
            f"--{name}=...). For copies of a whole model on each device use "
            "--strategy=mirrored without it.")

  def _check_objective(self) -> None:
    """`loss` and `metrics`: names are Keras' to check (when the Trainer is
    made); references to the user's functions are checked here."""
    for what, values in (("loss", (self.loss,)),
                         ("metrics", self.metrics or ())):
      for value in values:
        if value is not None and (not isinstance(value, str)
                                  or not value.strip()):
          raise ValueError(f"{what}={value!r} must be a Keras name or "
                           f"{user_code.FORMS}.")
        if user_code.is_reference(value):
          user_code.check_reference(what, value, _OBJECTIVE_CALL)

  def check_user_code(self) -> None:
    """Imports the functions this config names as `module:function`
    (model, dataset, loss, metrics) and checks their signatures; names of
    registered models and datasets are only looked up. Importing the
    user's modules may import TensorFlow.

    Raises:
      tfmgpu.user_code.UserCodeError: a reference that cannot be used.
    """
    models_lib.model_builder(self.model)
    data_lib.dataset_entry(self.dataset)
    self.loss_and_metrics()

  def loss_and_metrics(self) -> tuple[Any, list[Any] | None]:
    """`loss` and `metrics` for the Trainer: names as given, references
    imported (`fn(y_true, y_pred)`, signature checked).

    Raises:
      tfmgpu.user_code.UserCodeError: a reference that cannot be used.
    """
    def resolve(what: str, value: Any) -> Any:
      if user_code.is_reference(value):
        return user_code.load_function(what, value, _OBJECTIVE_CALL)
      return value
    metrics = self.metrics
    if metrics is None and self.loss is None:
      metrics = data_lib.default_metrics(self.dataset)
    metrics = (None if metrics is None
               else [resolve("metrics", m) for m in metrics])
    return resolve("loss", self.loss), metrics

  def _check_numbers(self) -> None:
    if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
      raise ValueError(f"bytes_per_pack={self.bytes_per_pack!r} must be >= 0.")
    for name in ("global_batch_size", "epochs", "num_packs",
                 "steps_per_execution", "num_stages", "micro_batches",
                 "data_parallel", "tensor_parallel"):
      checks.check_positive(name, getattr(self, name))
    for name in ("virtual_devices", "num_gpus", "num_replicas",
                 "steps_per_epoch", "variable_shards",
                 "checkpoint_every_steps"):
      checks.check_positive(name, getattr(self, name), allow_none=True)
    if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
      raise ValueError(f"checkpoint_every_s={self.checkpoint_every_s} must be "
                       "> 0 seconds (or None: save per epoch only).")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate={self.learning_rate} must be > 0.")
    if self.device_memory_gb is not None and not self.device_memory_gb > 0:
      raise ValueError(f"device_memory_gb={self.device_memory_gb} must be > 0 "
                       "GB (or None: 16).")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0 (or None).")
    chosen = [n for n in ("devices", "num_gpus", "num_replicas")
              if getattr(self, n) is not None]
    if len(chosen) > 1:
      raise ValueError(f"Set only one of {chosen}: each chooses the devices.")

  @property
  def distribution(self) -> strategies_lib.Distribution:
    """The registered strategy or placement this config names."""
    return strategies_lib.lookup(self.strategy)

  @property
  def is_placement(self) -> bool:
    """True for model/pipeline/branch parallelism (the model is split)."""
    return self.distribution.kind is strategies_lib.Kind.PLACEMENT

  @property
  def options(self) -> Any:
    """The distribution's typed options (its `Options` dataclass)."""
    return self.distribution.options_from(self)

  def model_options(self) -> dict[str, Any]:
    """The options of `models.build_model(self.model, ...)` this config sets
    (`size=` for `model_size`)."""
    options = {} if self.model_size is None else {"size": self.model_size}
    if self.model_preset is not None:
      options["preset"] = self.model_preset
    return options

  def dataset_options(self) -> dict[str, Any]:
    """The options of `data.load_dataset(self.dataset, ...)` this config sets."""
    entry = data_lib.dataset_entry(self.dataset)
    values = {"path": self.data_path, "seed": self.seed,
              "skip_damaged_shards": self.skip_damaged_shards}
    options = {k: v for k, v in values.items()
               if k in entry.options and v is not None}
    options.update(models_lib.dataset_options(self.model, self.model_size,
                                              self.dataset))
    return options

  def replace(self, **changes: Any) -> "TrainConfig":
    """A copy with `changes` applied (and validated). A new `model` brings
    its own default dataset when this config's was the default one."""
    if "model" in changes:
      if "dataset" not in changes and self.dataset == (
          models_lib.default_dataset(self.model, DEFAULT_DATASET)):
        changes["dataset"] = None
      if "model_size" not in changes and self.model_size == (
          models_lib.default_size(self.model)):
        changes["model_size"] = None
    return dataclasses.replace(self, **changes)
