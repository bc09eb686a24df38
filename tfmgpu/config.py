"""What a run is: frozen, validated dataclasses.

The CLI turns flags into a `TrainConfig` once; notebooks build one with
keyword arguments. Validation happens here, in `__post_init__`, so both
paths get the same clear errors. Importing this module does not import
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import strategies as strategies_lib

OPTIMIZER_CHOICES = ("adam", "sgd", "momentum", "rmsprop", "adamw")
PARTITION_CHOICES = ("balanced", "params", "flops")
SCHEDULE_CHOICES = ("gpipe", "1f1b")
# Mirrors tfmgpu.training.allreduce (which imports TensorFlow).
COMPRESSION_CHOICES = ("none", "float16", "bfloat16")
# Used by tfmgpu.training.resident: `auto` holds the training arrays on the
# devices when all replicas' copies together take at most DEVICE_DATA_MAX_MIB.
INPUT_MODE_CHOICES = ("auto", "device", "tf_data")
DEVICE_DATA_MAX_MIB = 512


def _positive(name: str, value: Any, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer.")


def _choice(name: str, value: Any, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} is unknown. Choose one of "
                     f"{', '.join(choices)}.")


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
    model: a registered model name.
    dataset: a registered dataset name; `data_path` for `npz` or a local
      copy of a downloadable one.
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
    model_dir: checkpoints, summaries and the saved model; an existing one
      is resumed. `None`: a new directory under `runs/`.
    seed: weights and data order.
    num_stages, partition, split_points: model/pipeline parallelism.
    micro_batches, schedule, recompute: pipeline parallelism.
    verbose: 1 for a progress bar, 0 for one log line per epoch.
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
  model: str = "convnet"
  dataset: str = "digits"
  data_path: str | None = None
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
  model_dir: str | None = None
  seed: int = 0
  num_stages: int = 2
  partition: str = "balanced"
  split_points: tuple[str, ...] | None = None
  micro_batches: int = 4
  schedule: str = "gpipe"
  recompute: bool = False
  verbose: int = 1

  def __post_init__(self):
    _choice("strategy", self.strategy, tuple(strategies_lib.available_strategies()))
    _choice("model", self.model, tuple(models_lib.available_models()))
    _choice("dataset", self.dataset, tuple(data_lib.available_datasets()))
    _choice("cross_device_ops", self.cross_device_ops,
            strategies_lib.CROSS_DEVICE_OPS_CHOICES)
    _choice("single_replica", self.single_replica,
            strategies_lib.SINGLE_REPLICA_CHOICES)
    _choice("communication", self.communication,
            strategies_lib.COMMUNICATION_CHOICES)
    _choice("cluster_resolver", self.cluster_resolver,
            tuple(strategies_lib.CLUSTER_RESOLVERS))
    _choice("optimizer", self.optimizer, OPTIMIZER_CHOICES)
    _choice("mixed_precision", self.mixed_precision,
            models_lib.MIXED_PRECISION_POLICIES)
    _choice("partition", self.partition, PARTITION_CHOICES)
    _choice("gradient_compression", self.gradient_compression,
            COMPRESSION_CHOICES)
    if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
      raise ValueError(f"bytes_per_pack={self.bytes_per_pack!r} must be >= 0.")
    _choice("schedule", self.schedule, SCHEDULE_CHOICES)
    _choice("input_mode", self.input_mode, INPUT_MODE_CHOICES)
    for name in ("global_batch_size", "epochs", "num_packs",
                 "steps_per_execution", "num_stages", "micro_batches"):
      _positive(name, getattr(self, name))
    for name in ("virtual_devices", "num_gpus", "num_replicas",
                 "steps_per_epoch"):
      _positive(name, getattr(self, name), allow_none=True)
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate={self.learning_rate} must be > 0.")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0 (or None).")
    chosen = [n for n in ("devices", "num_gpus", "num_replicas")
              if getattr(self, n) is not None]
    if len(chosen) > 1:
      raise ValueError(f"Set only one of {chosen}: each chooses the devices.")
    if (self.virtual_devices and self.num_replicas is None
        and self.devices is None and self.num_gpus is None
        and self.strategy in ("mirrored", "central_storage")
        and self.global_batch_size % self.virtual_devices):
      v = self.virtual_devices
      raise ValueError(
          f"global_batch_size={self.global_batch_size} is not divisible by the "
          f"{v} replicas of {self.strategy!r} (virtual_devices={v}). Use a "
          f"multiple of {v}, e.g. {max(v, self.global_batch_size // v * v)}.")
    if self.dataset == "npz" and not self.data_path:
      raise ValueError("dataset='npz' needs data_path='file.npz'.")

  @property
  def is_placement(self) -> bool:
    """True for model/pipeline/branch parallelism (the model is split)."""
    return (strategies_lib.strategy_entry(self.strategy).kind
            is strategies_lib.Kind.PLACEMENT)

  def strategy_options(self) -> dict[str, Any]:
    """The options of `get_strategy(self.strategy, ...)` this config sets.

    Read from the registered builder's signature, so a new strategy's options
    need no code here.
    """
    entry = strategies_lib.strategy_entry(self.strategy)
    if entry.builder is None:
      return {}
    params = inspect.signature(entry.builder).parameters
    return {p: getattr(self, p) for p in params
            if hasattr(self, p) and getattr(self, p) is not None}

  def dataset_options(self) -> dict[str, Any]:
    """The options of `data.load_dataset(self.dataset, ...)` this config sets."""
    params = inspect.signature(data_lib.dataset_entry(self.dataset).loader
                               ).parameters
    values = {"path": self.data_path, "seed": self.seed}
    return {p: v for p, v in values.items() if p in params and v is not None}

  def replace(self, **changes: Any) -> "TrainConfig":
    """A copy with `changes` applied (and validated)."""
    return dataclasses.replace(self, **changes)
