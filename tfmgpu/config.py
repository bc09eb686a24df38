"""What a run is: frozen, validated dataclasses.

The CLI turns flags into a `TrainConfig` once; notebooks build one with
keyword arguments. Validation happens here, in `__post_init__`, so both
paths get the same clear errors. Importing this module does not import
TensorFlow.

Every setting is declared once (`tfmgpu.settings.setting`): a run's own in
`RunSettings`, a distribution's in its `Options` dataclass. `TrainConfig`
is made from them (`make_train_config`): `RunSettings` plus one field per
option of every registered distribution, with the run's default; the CLI
flags are made from the same declarations (`tfmgpu.flags`). Adding an
option is one field of an `Options` dataclass: register a plugin's
distribution before this module is imported to give it its fields.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

from absl import logging as absl_logging

from tfmgpu import checks
from tfmgpu import cluster
from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import rundir
from tfmgpu import strategies as strategies_lib
from tfmgpu import settings
from tfmgpu import user_code
from tfmgpu.settings import setting
from tfmgpu.training.choices import COMPRESSION_CHOICES
from tfmgpu.training.choices import DEVICE_DATA_MAX_MIB
from tfmgpu.training.choices import INPUT_MODE_CHOICES
from tfmgpu.training.optimizers import OPTIMIZER_CHOICES

# How a loss or metric function named by reference is called.
_OBJECTIVE_CALL = user_code.Call(args=(0, 0), shown="fn(y_true, y_pred)")


class ConfigRuleError(ValueError):
  """Settings that are each valid but break a rule together (e.g. a global
  batch that the pipeline's micro-batches do not divide)."""


DEFAULT_DATASET = "digits"  # For models that name no dataset of their own.


def _model_help() -> str:
  return (f"<{' | '.join(models_lib.available_models())}>, or your own "
          f"builder as {user_code.FORMS}, called as build(input_shape, "
          "num_classes) -> keras.Model (input_shape nested like the data's x "
          "for several inputs).")


def _model_size_help() -> str:
  return ("A named size of --model, for models that have them: "
          + "; ".join(f"{name}: <{' | '.join(sizes)}>"
                      for name, sizes in models_lib.model_sizes().items())
          + ". Default: the model's own (gpt: tiny).")


def _dataset_help() -> str:
  return (
      f"<{' | '.join(data_lib.available_datasets())}>, or your own loader as "
      f"{user_code.FORMS}, called as load() (with seed=/path= if it takes "
      "them) and returning ((x_train, y_train), (x_test, y_test)) like "
      "keras.datasets (x may be a dict of arrays), or what Trainer.fit "
      "takes: a tf.data.Dataset of (x, y) batches, a dataset function, or a "
      "(train, test) pair of them. Default: train: the model's own (gpt: "
      "stdlib_text), else digits (real digits that ship offline); predict: "
      "the dataset the model's run trained on (its run.json, which names "
      "your files by absolute path), else digits.")


# Options of other strategies already said to be ignored (see
# `TrainConfig._warn_unused_options`).
_SAID_UNUSED: set[tuple[str, str, str]] = set()


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """A run's own settings; `TrainConfig` adds every distribution's options.

  Each field is declared once with `tfmgpu.settings.setting`: its help is
  the CLI flag's and the line `TrainConfig`'s docstring gives it.
  `_distribution` (not a field) hands in the registered distribution that
  `strategy` names when the caller has it already (`replace`, the CLI's
  flag check): the registry is then not asked again.
  """
  strategy: str = setting(
      "mirrored", "How to spread work over devices; see "
      "tfmgpu.available_strategies().",
      choices=lambda: list(strategies_lib.available_strategies()))
  virtual_devices: int | None = setting(
      None, "Split the GPU (else the CPU) into this many logical devices "
      "first: simulates a multi-device host.", lower_bound=1)
  model: str = setting("convnet", _model_help)
  model_size: str | None = setting(None, _model_size_help)
  model_preset: str | None = setting(
      None, "A local keras_hub preset directory (config.json and weights; "
      "nothing is downloaded) that a keras_hub --model (gpt2, llama, gemma, "
      "qwen, bert) loads instead of building --model_size.")
  dataset: str | None = setting(None, _dataset_help)
  data_path: str | None = setting(
      None, ".npz file (x_train, y_train, x_test, y_test) for "
      "--dataset=npz (x used as it is, as float32; uint8 arrays, images "
      "0..255, divided by 255 in both splits, (n, H, W) ones given a "
      "channel axis; y integer class indices: other targets need your own "
      "--dataset loader), a glob of TFRecord shards for --dataset=tfrecord "
      "(quoted: 'DIR/*.tfrecord'), or a local copy of a downloadable "
      "dataset.")
  loss: str | None = setting(
      None, "A Keras loss name (e.g. mse, binary_crossentropy) or your "
      f"fn(y_true, y_pred) as {user_code.FORMS}. Default: sparse categorical "
      "cross-entropy from logits, which the built-in models output (by name, "
      "sparse_categorical_crossentropy expects probabilities).")
  metrics: tuple[str, ...] | None = setting(
      None, "Keras metric names (e.g. accuracy,mae) or your "
      "fn(y_true, y_pred) as references, comma-separated; reported per epoch "
      "and in the summary; language models also take bits_per_byte and "
      "perplexity (from logits). Default: the dataset's (accuracy; "
      "stdlib_text: bits_per_byte,perplexity,accuracy) with the default "
      "loss, none with --loss.")
  global_batch_size: int = setting(
      64, "Examples per step over all replicas.", lower_bound=1)
  epochs: int = setting(5, "Epochs to train.", lower_bound=1)
  steps_per_epoch: int | None = setting(
      None, "Steps per epoch (default: one pass).", lower_bound=1)
  optimizer: str = setting("adam", "Optimizer.", choices=OPTIMIZER_CHOICES)
  learning_rate: float = setting(2e-3, "Learning rate.", lower_bound=0.0)
  clip_norm: float | None = setting(
      None, "Clip gradients to this global norm.")
  gradient_compression: str = setting(
      "none", "All-reduce gradients in 16 bits (half the bytes on the "
      "wire).", choices=COMPRESSION_CHOICES)
  bytes_per_pack: int = setting(
      0, "All-reduce pack size in bytes (0: TF's default).", lower_bound=0)
  mixed_precision: str = setting(
      "float32", "Keras dtype policy; mixed_float16 adds loss scaling.",
      choices=models_lib.MIXED_PRECISION_POLICIES)
  steps_per_execution: int = setting(
      10, "Steps per tf.function call.", lower_bound=1)
  jit_compile: bool = setting(
      False, "XLA-compile each replica's forward/backward.")
  batch_splits: int = setting(
      1, "Cut each replica's batch into this many row slices trained side "
      "by side, gradients summed (equal up to float rounding; keeps a CPU's "
      "cores busier; refused for BatchNormalization or regularized "
      "models).", lower_bound=1)
  fused_optimizer: bool = setting(
      True, "Update each variable with one fused kernel (adam, adamw, sgd, "
      "momentum); false: Keras's per-op update.")
  input_mode: str = setting(
      "auto", "device: hold the training arrays on each replica's device "
      "and gather batches there; tf_data: a tf.data pipeline; auto: device "
      f"on one host when all replicas' copies take <= {DEVICE_DATA_MAX_MIB} "
      "MiB. A tf.data.Dataset on CPU replicas is read once on the host and "
      "split in the step, unless tf_data (TF's distributed iterator).",
      choices=INPUT_MODE_CHOICES)
  autotune: bool = setting(
      False, "Before training, time short runs of input_mode, "
      "steps_per_execution, jit_compile, gradient_compression and "
      "batch_splits and train "
      "with the fastest (`tfmgpu.training.autotune`; cached per machine, "
      "model and replica count; one-host data-parallel runs only).",
      flag=False)  # Its flag is `tfmgpu.flags.autotune`'s (bench: on).
  model_dir: str | None = setting(
      None, "Checkpoints, TensorBoard summaries (the run's summary prints "
      "the tensorboard --logdir command) and model.keras go here; an "
      "existing run directory is resumed (a folder holding a model.keras "
      "that no run wrote is refused). Default: a new "
      "runs/<time>-<strategy>.")
  checkpoint_every_steps: int | None = setting(
      None, "Also save a checkpoint every N global steps, not only per "
      "epoch: where the first call of --steps_per_execution steps reaching "
      "each multiple of N ends (parameter_server too).", lower_bound=1)
  checkpoint_every_s: float | None = setting(
      None, "Also save a checkpoint every N seconds of training, not only "
      "per epoch.", lower_bound=0.001)
  seed: int = setting(0, "Seed for weights and data order.")
  skip_damaged_shards: bool = setting(
      False, "--dataset=tfrecord: read every shard through first and train "
      "without the damaged ones (logged); off, a damaged shard stops the "
      "run, naming it.")
  verbose: int = setting(
      1, "0: one log line per epoch; 1: a progress line (one plain line per "
      "epoch when stdout is not a terminal); 2: that and TensorFlow's own "
      "log messages (hidden otherwise, unless TF_CPP_MIN_LOG_LEVEL is set).",
      lower_bound=0, upper_bound=2)

  _distribution: dataclasses.InitVar[Any] = None  # Keyword only, in effect.

  def __post_init__(self, _distribution: Any = None):
    if isinstance(self.metrics, str):  # "mae,mse", as the flag takes it.
      object.__setattr__(self, "metrics", tuple(
          m.strip() for m in self.metrics.split(",") if m.strip()))
    for name in ("devices", "split_points", "metrics"):
      if getattr(self, name) is not None:  # Lists from notebooks are fine.
        object.__setattr__(self, name, tuple(getattr(self, name)))
    for name in ("devices", "split_points"):  # `--devices=`: none given.
      if getattr(self, name) == ():
        object.__setattr__(self, name, None)
    # Resolved once: a caller that has the distribution hands it in.
    distribution = _distribution
    if distribution is None or distribution.name != str(self.strategy).lower():
      distribution = strategies_lib.lookup(self.strategy)
    object.__setattr__(self, "_distribution", distribution)
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
    # Every declared choice, the options of distributions other than the
    # run's too, so a typo never waits for the strategy that reads it.
    for field in dataclasses.fields(self):
      spec = settings.declared(field)
      if spec is not None and spec.choices is not None:
        checks.check_choice(field.name, getattr(self, field.name),
                            spec.choice_list())
    self._check_numbers()
    self._check_layout_sizes(distribution)
    # Refused before the warning that the run would ignore it.
    self._check_zero_stage(distribution)
    self._warn_unused_options(distribution)
    # The run's distribution checks its options and cross-field rules.
    object.__setattr__(self, "_options", distribution.options_of(
        self.values_of(distribution.Options)))
    try:
      distribution.check_config(self._options, self.run_facts)
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
    """A layout size (`data_parallel`, `tensor_parallel`, `tensor_rules`:
    the options declared `record=Record.SIZE`) given to a strategy that
    does not take it: an error, not silently ignored."""
    takes = {f.name for f in dataclasses.fields(distribution.Options)}
    for field in dataclasses.fields(self):
      spec, name = settings.declared(field), field.name
      if spec is None or spec.record is not settings.Record.SIZE:
        continue
      value = getattr(self, name)
      if value != field.default and name not in takes:
        users = [d.name for d in strategies_lib.registered().values()
                 if name in {f.name for f in dataclasses.fields(d.Options)}]
        raise ValueError(
            f"{name}={value!r} is not an option of strategy="
            f"{self.strategy!r}; it shapes the layouts of "
            f"{', '.join(users)} (e.g. --strategy=pipeline --num_stages=2 "
            f"--{name}=...). For copies of a whole model on each device use "
            "--strategy=mirrored without it.")

  def _warn_unused_options(self, distribution: Any) -> None:
    """Another strategy's option set away from its default (`--num_stages`
    with `--strategy=mirrored`): said once, as the run ignores it."""
    # The run's own settings (`global_batch_size`) are used by every
    # strategy, whichever Options also name them.
    takes = {f.name for f in dataclasses.fields(distribution.Options)} | {
        f.name for f in dataclasses.fields(RunSettings)}
    others: dict[str, list[str]] = {}
    for d in strategies_lib.registered().values():
      for f in dataclasses.fields(d.Options):
        others.setdefault(f.name, []).append(d.name)
    for field in dataclasses.fields(self):
      name, value = field.name, getattr(self, field.name)
      said = (name, repr(value), self.strategy)
      if (name in others and name not in takes and value != field.default
          and field.default is not dataclasses.MISSING
          and said not in _SAID_UNUSED):  # Once: replace() checks again.
        _SAID_UNUSED.add(said)
        absl_logging.warning(
            "%s=%r is an option of %s, not of strategy=%r: this run ignores "
            "it.", name, value, ", ".join(others[name]), self.strategy)

  def _check_zero_stage(self, distribution: Any) -> None:
    """`zero_stage` for a strategy that cannot shard: an error that says
    what works."""
    takes = {f.name for f in dataclasses.fields(distribution.Options)}
    if self.zero_stage and "zero_stage" not in takes:
      raise ValueError(
          f"zero_stage={self.zero_stage!r} is not supported by strategy="
          f"{self.strategy!r}: tfmgpu shards weights, gradients and optimizer "
          "slots (ZeRO) over data-parallel replicas. Use "
          f"--strategy=mirrored --zero_stage={self.zero_stage} on one host "
          "(with --virtual_devices=N on a CPU), --strategy="
          "multi_worker_mirrored across hosts, or drop --zero_stage.")

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
    # Counts: the settings declared as integers of at least 1 (the flag's
    # bound), and `num_gpus`, whose flag takes 0 but a run needs one.
    for field, type_ in settings.fields_of(type(self)):
      spec = settings.declared(field)
      if (field.name == "num_gpus" or spec is not None
          and spec.lower_bound == 1 and int in (type_, *typing.get_args(type_))):
        checks.check_positive(field.name, getattr(self, field.name),
                              allow_none=field.default is None)
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
    """The registered strategy or placement this config names (looked up
    once, when the config is made)."""
    return self._distribution

  @property
  def is_placement(self) -> bool:
    """True for model/pipeline/branch parallelism (the model is split)."""
    return self.distribution.kind is strategies_lib.Kind.PLACEMENT

  @property
  def options(self) -> Any:
    """The distribution's typed options (its `Options` dataclass), made
    and checked once, when the config is made."""
    return self._options

  @property
  def run_facts(self) -> strategies_lib.RunFacts:
    """What the distribution's cross-field rules read besides its options."""
    return strategies_lib.RunFacts(
        global_batch_size=self.global_batch_size,
        virtual_devices=self.virtual_devices, model=self.model,
        model_size=self.model_size)

  @property
  def recorded_run(self) -> rundir.RecordedRun:
    """What `run.json` records of this run (`rundir.record_of`)."""
    layout = self.distribution.record(self.options)
    return rundir.RecordedRun(
        strategy=self.strategy, placement=layout["placement"],
        micro_batches=layout["micro_batches"],
        portable=bool(layout.get("portable")), model=self.model,
        model_size=self.model_size, optimizer=self.optimizer,
        global_batch_size=self.global_batch_size, seed=self.seed,
        dataset=self.dataset, learning_rate=self.learning_rate,
        epochs=self.epochs, steps_per_epoch=self.steps_per_epoch,
        loss=self.loss, metrics=self.metrics, data_path=self.data_path)

  @property
  def cluster_target(self) -> cluster.ClusterTarget:
    """What this run asks of its cluster (`cluster.preflight`)."""
    return cluster.ClusterTarget(
        self.distribution, self.cluster_resolver,
        in_graph=self.distribution.in_graph(self.options))

  def values_of(self, cls: type) -> dict[str, Any]:
    """This config's values of the fields of the dataclass `cls` that are
    settings: what a layer below takes instead of the config (an
    `Options`, `TrainerOptions`)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(cls)
            if f.name in self.__dataclass_fields__}

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
    if changes.get("strategy", self.strategy) == self.strategy:
      changes["_distribution"] = self._distribution  # No second lookup.
    return dataclasses.replace(self, **changes)


def _option_fields(run_fields: set[str]) -> list[tuple[str, Any, Any]]:
  """`(name, type, field)` for each option of the registered
  distributions that is not a run setting, from its first declaration
  (registration order), with the run's default.

  Raises:
    TypeError: an option nobody declared with `tfmgpu.settings.setting`.
  """
  found: dict[str, tuple[str, Any, Any]] = {}
  undeclared: dict[str, str] = {}
  for distribution in strategies_lib.registered().values():
    for field, type_ in settings.fields_of(distribution.Options):
      if field.name in run_fields or field.name in found:
        continue
      if settings.declared(field) is None:
        undeclared.setdefault(field.name, distribution.name)
        continue
      found[field.name] = (field.name, type_, dataclasses.field(
          default=settings.run_default(field), metadata=field.metadata))
  missing = {n: d for n, d in undeclared.items() if n not in found}
  if missing:
    raise TypeError(
        "Options without a declaration: " + ", ".join(
            f"{n!r} of strategy {d!r}" for n, d in missing.items())
        + ". Declare each with tfmgpu.settings.setting(default, help).")
  return list(found.values())


def _docstring(cls: type) -> str:
  """`TrainConfig`'s docstring: one entry per field, from its help."""
  lines = ["One training run. Every field has a working default.", "",
           "Fields are declared once (`tfmgpu.settings.setting`): a run's own "
           "in `RunSettings`, each distribution's options in its `Options`.",
           "", "Attributes:"]
  for field in dataclasses.fields(cls):
    lines += textwrap.wrap(f"{field.name}: {settings.declared(field).help_text()}",
                           76, initial_indent="  ", subsequent_indent="    ",
                           break_on_hyphens=False, break_long_words=False)
  return "\n".join(lines) + "\n"


def make_train_config() -> type:
  """The `TrainConfig` class of the distributions registered now:
  `RunSettings` plus their options (see the module docstring)."""
  run_fields = {f.name for f in dataclasses.fields(RunSettings)}
  cls = dataclasses.make_dataclass(
      "TrainConfig", _option_fields(run_fields), bases=(RunSettings,),
      frozen=True)
  cls.__module__ = __name__  # Pickled and shown as tfmgpu.config's.
  cls.__doc__ = _docstring(cls)
  return cls


TrainConfig = make_train_config()
