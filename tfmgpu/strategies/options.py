"""The options dataclasses of the data-parallel distributions.

Each option is declared once (`tfmgpu.settings.setting`: help, choices,
bounds, a run's default); `TrainConfig`'s field and the CLI flag are made
from that declaration, so every option is reachable. Each dataclass
validates its values. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmgpu import checks
from tfmgpu import settings
from tfmgpu.settings import setting
from tfmgpu.strategies.replicas import CROSS_DEVICE_OPS_CHOICES
from tfmgpu.strategies.resolvers import CLUSTER_RESOLVERS

@dataclasses.dataclass(frozen=True)
class DeviceOptions:
  """Which devices replicate: at most one of the three.

  Attributes:
    devices: explicit replica devices, e.g. `("/gpu:0", "/gpu:1")`.
    num_gpus: the first N GPUs.
    num_replicas: the first N accelerator devices (GPUs, else logical CPUs).
  """
  devices: tuple[str, ...] | None = setting(
      None, "Explicit replica devices, e.g. /gpu:0,/gpu:1.")
  num_gpus: int | None = setting(None, "Use the first N GPUs.",
                                 lower_bound=0)
  num_replicas: int | None = setting(
      None, "Use the first N accelerator devices (GPUs, else logical CPUs).",
      lower_bound=1)

  def __post_init__(self):
    given = [n for n in ("devices", "num_gpus", "num_replicas")
             if getattr(self, n) is not None]
    if len(given) > 1:
      raise ValueError(f"Pass only one of {given}: they all choose devices.")
    if self.devices is not None:
      object.__setattr__(self, "devices", tuple(self.devices))


SINGLE_REPLICA_CHOICES = ("default", "mirrored")
# ZeRO stages of sharded data parallelism (`tfmgpu.parallel.zero`): 0 keeps
# whole copies; 1 shards the optimizer slots over the data-parallel devices,
# 2 also the summed gradients, 3 also the weights.
ZERO_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class MirroredOptions(DeviceOptions):
  """Options of `mirrored`.

  Attributes:
    cross_device_ops: `auto`, `nccl`, `hierarchical_copy`,
      `reduction_to_one` (see `choose_cross_device_ops`).
    num_packs: gradient packs for all-reduce.
    single_replica: with one replica on the default device, `mirrored`
      (the default here, what code written for tf.distribute expects) keeps
      `MirroredStrategy`; `default` uses TF's default strategy, which does
      the same work without the wrapping overhead. tfmgpu's own runs
      (`TrainConfig`, the CLIs) choose `default`.
    zero_stage: shard the replicas' state over their devices (ZeRO,
      `tfmgpu.parallel.zero`): `1` the optimizer slots, `2` also the
      summed gradients, `3` also the weights; `0` (the default) keeps a
      whole copy on every device (`MirroredStrategy`).
  """
  cross_device_ops: str = setting(
      "auto", "All-reduce implementation for 'mirrored'; auto picks NCCL "
      "only when every replica is a GPU.", choices=CROSS_DEVICE_OPS_CHOICES)
  num_packs: int = setting(1, "Gradient packs for all-reduce.",
                           lower_bound=1)
  single_replica: str = setting(
      "mirrored", "'mirrored' with one replica: 'default' skips "
      "MirroredStrategy's overhead; 'mirrored' keeps it.",
      choices=SINGLE_REPLICA_CHOICES, run_default="default")
  zero_stage: int = setting(
      0, "'mirrored', 'multi_worker_mirrored': shard state over the "
      "replicas (ZeRO): 1 optimizer slots, 2 also gradients, 3 also "
      "weights; 0 whole copies.",
      lower_bound=0, upper_bound=3)

  def __post_init__(self):
    super().__post_init__()
    checks.check_choice("cross_device_ops", self.cross_device_ops,
                        CROSS_DEVICE_OPS_CHOICES)
    checks.check_positive("num_packs", self.num_packs)
    checks.check_choice("single_replica", self.single_replica,
                        SINGLE_REPLICA_CHOICES)
    checks.check_choice("zero_stage", self.zero_stage, ZERO_STAGES)


@dataclasses.dataclass(frozen=True)
class OneDeviceOptions:
  """Options of `one_device`: `devices`, at most one (default: the first
  accelerator)."""
  devices: tuple[str, ...] | None = settings.with_default(DeviceOptions,
                                                          "devices", None)

  def __post_init__(self):
    if self.devices is not None and len(self.devices) != 1:
      raise ValueError(f"one_device takes exactly one device; got devices="
                       f"{list(self.devices)}. Use 'mirrored' for several.")


COMMUNICATION_CHOICES = ("auto", "ring", "nccl")


def _check_connect_timeout(seconds: float) -> None:
  """`connect_timeout_s` of the options whose task waits for the others."""
  if not seconds > 0:
    raise ValueError(f"connect_timeout_s={seconds!r} must be > 0 seconds.")


@dataclasses.dataclass(frozen=True)
class MultiWorkerOptions:
  """Options of `multi_worker_mirrored`.

  Attributes:
    communication: collective implementation: `auto`, `ring`, `nccl`.
    cluster_resolver: `tf_config`, `slurm`, or a `ClusterResolver`.
    zero_stage: shard the state over every worker's replica devices (ZeRO,
      run in-graph: the chief drives the other tasks' devices,
      `tfmgpu.in_graph`); `0` keeps a whole copy on every worker.
    connect_timeout_s: how long each task waits for the others to listen
      (every worker for its peers; with `zero_stage`, the chief for the
      tasks it drives) before it gives up with an error naming the missing
      ones (TensorFlow's own connect would wait forever, deaf to SIGTERM,
      for a task that died or was never started). Defaults to `300`.
  """
  communication: str = setting(
      "auto", "Collective implementation for 'multi_worker_mirrored'.",
      choices=COMMUNICATION_CHOICES)
  cluster_resolver: Any = setting(
      "tf_config", "Where the cluster comes from for multi-worker "
      "strategies.", choices=tuple(CLUSTER_RESOLVERS))
  zero_stage: int = settings.with_default(MirroredOptions, "zero_stage", 0)
  connect_timeout_s: float = setting(
      300.0, "Seconds a task waits for the tasks it needs to listen (each "
      "multi_worker_mirrored worker for its peers, the parameter-server "
      "coordinator for every task) before it stops with an error naming the "
      "missing ones (default 300).", lower_bound=0.001, run_default=None)

  def __post_init__(self):
    checks.check_choice("communication", self.communication,
                        COMMUNICATION_CHOICES)
    checks.check_choice("zero_stage", self.zero_stage, ZERO_STAGES)
    _check_connect_timeout(self.connect_timeout_s)


@dataclasses.dataclass(frozen=True)
class ParameterServerOptions:
  """Options of `parameter_server`.

  Attributes:
    cluster_resolver: `tf_config`, `slurm`, or a `ClusterResolver`.
    variable_shards: split each variable over this many parameter servers
      (`FixedShardsPartitioner`); `None` keeps variables whole.
    connect_timeout_s: how long the coordinator waits for every ps and
      worker task to listen before it gives up (TensorFlow's own connect
      would wait forever for a task that died). Defaults to `300`.
  """
  cluster_resolver: Any = settings.with_default(MultiWorkerOptions,
                                                "cluster_resolver", "tf_config")
  variable_shards: int | None = setting(
      None, "'parameter_server': split each variable over this many "
      "parameter servers.", lower_bound=1)
  connect_timeout_s: float = settings.with_default(
      MultiWorkerOptions, "connect_timeout_s", 300.0)

  def __post_init__(self):
    checks.check_positive("variable_shards", self.variable_shards,
                          allow_none=True)
    _check_connect_timeout(self.connect_timeout_s)


@dataclasses.dataclass(frozen=True)
class CentralStorageOptions(DeviceOptions):
  """Options of `central_storage`: the replica devices and
  `parameter_device`, where the variables live (default `/cpu:0`)."""
  parameter_device: str | None = setting(
      None, "'central_storage': where the variables live (default /cpu:0).")


@dataclasses.dataclass(frozen=True)
class TpuOptions:
  """Options of `tpu`: `tpu`, the TPU's name or address (`""`: this VM's)."""
  tpu: str = setting(
      "", "'tpu': the TPU's name or address (empty: this TPU VM's).")
