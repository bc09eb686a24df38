"""The data-parallel distributions: replicas of the whole model.

`default`, `one_device`, `mirrored`, `multi_worker_mirrored`,
`parameter_server`, `central_storage` and `tpu`, each one `Distribution`
(`tfmgpu.strategies.registry`) with its options dataclass, building a
genuine `tf.distribute.Strategy`. Also how replica devices and the
all-reduce implementation are chosen.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from absl import logging

from tfmgpu import checks
from tfmgpu._lazy import LazyModule
from tfmgpu.strategies import registry
from tfmgpu.strategies import resolvers

# The CLIs list the names in `--help` before TensorFlow loads: TensorFlow is
# imported on first use.
tf = LazyModule("tensorflow")
devices_lib = LazyModule("tfmgpu.devices")


# --------------------------------------------------------------- devices

def _replica_devices(devices: Sequence[str] | None, num_gpus: int | None,
                     num_replicas: int | None) -> list[str]:
  """Chooses the devices a data-parallel strategy replicates over."""
  if devices is not None:
    if not devices:
      raise ValueError("devices=[] is empty; name at least one device.")
    return devices_lib.resolve_devices(devices)
  layout = devices_lib.current_layout()
  if num_gpus is not None:
    if num_gpus < 0 or num_gpus > len(layout.gpus):
      raise ValueError(
          f"num_gpus={num_gpus} but this machine has {len(layout.gpus)} GPU(s). "
          f"Devices found: {', '.join(layout.cpus + layout.gpus)}. "
          + ("Use num_replicas=N with --virtual_devices=N to simulate replicas "
             "on the CPU." if not layout.gpus else
             f"Use num_gpus<={len(layout.gpus)}."))
    return list(layout.gpus[:num_gpus]) or [layout.cpus[0]]
  accel = list(layout.accelerators)
  if num_replicas is not None:
    if num_replicas < 1 or num_replicas > len(accel):
      raise ValueError(
          f"num_replicas={num_replicas} but only {len(accel)} device(s) exist: "
          f"{', '.join(accel)}. Split a device first with "
          "tfmgpu.configure_devices(logical_cpus=N) (CLI: --virtual_devices=N).")
    return accel[:num_replicas]
  return accel


def _is_gpu(device: str) -> bool:
  return tf.DeviceSpec.from_string(device).device_type == "GPU"


# ------------------------------------------------------ cross-device ops

_CROSS_DEVICE_OPS: dict[str, Callable[[int], "tf.distribute.CrossDeviceOps"]] = {
    "nccl": lambda packs: tf.distribute.NcclAllReduce(num_packs=packs),
    "hierarchical_copy":
        lambda packs: tf.distribute.HierarchicalCopyAllReduce(num_packs=packs),
    "reduction_to_one": lambda packs: tf.distribute.ReductionToOneDevice(),
}
CROSS_DEVICE_OPS_CHOICES = ("auto",) + tuple(_CROSS_DEVICE_OPS)


def choose_cross_device_ops(name: str, replica_devices: Sequence[str]) -> str:
  """Resolves `auto` and checks a choice against the replica devices.

  `auto` picks NCCL only when every replica is a GPU (NCCL kernels exist only
  for GPUs); otherwise `reduction_to_one`, which also lets strategies with
  different replica counts live in one process (TF's default CPU collectives
  do not).

  Raises:
    ValueError: unknown name, or NCCL with a non-GPU replica.
  """
  checks.check_choice("cross_device_ops", name, CROSS_DEVICE_OPS_CHOICES)
  all_gpu = bool(replica_devices) and all(_is_gpu(d) for d in replica_devices)
  if name == "auto":
    return "nccl" if all_gpu and len(replica_devices) > 1 else "reduction_to_one"
  if name == "nccl" and not all_gpu:
    raise ValueError(
        "cross_device_ops='nccl' needs every replica on a GPU, but replicas are "
        f"on {', '.join(replica_devices)}: NCCL has no CPU kernel and would "
        "fail at the first step. Use cross_device_ops='auto' or "
        "'reduction_to_one'.")
  return name


def make_cross_device_ops(name: str, replica_devices: Sequence[str],
                          num_packs: int = 1) -> tf.distribute.CrossDeviceOps:
  """Builds the cross-device ops object for `name` (see `choose_cross_device_ops`)."""
  if num_packs < 1:
    raise ValueError(f"num_packs={num_packs} must be >= 1.")
  return _CROSS_DEVICE_OPS[choose_cross_device_ops(name, replica_devices)](
      num_packs)




def short_device(name: str) -> str:
  """'/job:localhost/replica:0/task:0/device:CPU:1' -> '/device:CPU:1'."""
  return name.replace("/job:localhost/replica:0/task:0", "")


def replica_devices(strategy: "tf.distribute.Strategy") -> list[str]:
  """The devices a strategy's replicas run on, short names."""
  try:
    devices = list(strategy.extended.worker_devices)
  except (AttributeError, RuntimeError):  # The default strategy has none.
    devices = []
  return [short_device(d) for d in devices] or [
      devices_lib.accelerator_devices()[0]]


# ------------------------------------------------------------ the base

class DataParallel(registry.Distribution):
  """Replicas of the whole model: built in the strategy's scope."""

  def make_strategy(self, options: Any) -> "tf.distribute.Strategy":
    raise NotImplementedError

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    del seed  # The model's own initializers are seeded by `build`.
    strategy = strategy or self.make_strategy(options)
    with strategy.scope():
      model = build()
    return registry.Placement(strategy, replica_devices(strategy), model,
                              distribution=self, options=options)

  def serve(self, models: Sequence[Any], options: Any) -> tuple[Any, Any]:
    if len(models) != 1:
      raise ValueError(f"strategy {self.name!r} serves one model; got "
                       f"{len(models)} model paths.")
    return models[0], self.make_strategy(options)


# ------------------------------------------------------------- options

@dataclasses.dataclass(frozen=True)
class DeviceOptions:
  """Which devices replicate: at most one of the three.

  Attributes:
    devices: explicit replica devices, e.g. `("/gpu:0", "/gpu:1")`.
    num_gpus: the first N GPUs.
    num_replicas: the first N accelerator devices (GPUs, else logical CPUs).
  """
  devices: tuple[str, ...] | None = None
  num_gpus: int | None = None
  num_replicas: int | None = None

  def __post_init__(self):
    given = [n for n in ("devices", "num_gpus", "num_replicas")
             if getattr(self, n) is not None]
    if len(given) > 1:
      raise ValueError(f"Pass only one of {given}: they all choose devices.")
    if self.devices is not None:
      object.__setattr__(self, "devices", tuple(self.devices))


SINGLE_REPLICA_CHOICES = ("default", "mirrored")


@dataclasses.dataclass(frozen=True)
class MirroredOptions(DeviceOptions):
  """Options of `mirrored`.

  Attributes:
    cross_device_ops: `auto`, `nccl`, `hierarchical_copy`,
      `reduction_to_one` (see `choose_cross_device_ops`).
    num_packs: gradient packs for all-reduce.
    single_replica: with one replica on the default device, `default` uses
      the default strategy (no wrapping overhead); `mirrored` keeps
      `MirroredStrategy`.
  """
  cross_device_ops: str = "auto"
  num_packs: int = 1
  single_replica: str = "default"

  def __post_init__(self):
    super().__post_init__()
    checks.check_choice("cross_device_ops", self.cross_device_ops,
                        CROSS_DEVICE_OPS_CHOICES)
    checks.check_positive("num_packs", self.num_packs)
    checks.check_choice("single_replica", self.single_replica,
                        SINGLE_REPLICA_CHOICES)


@dataclasses.dataclass(frozen=True)
class OneDeviceOptions:
  """Options of `one_device`: `devices`, at most one (default: the first
  accelerator)."""
  devices: tuple[str, ...] | None = None

  def __post_init__(self):
    if self.devices is not None and len(self.devices) != 1:
      raise ValueError(f"one_device takes exactly one device; got devices="
                       f"{list(self.devices)}. Use 'mirrored' for several.")


COMMUNICATION_CHOICES = ("auto", "ring", "nccl")


@dataclasses.dataclass(frozen=True)
class MultiWorkerOptions:
  """Options of `multi_worker_mirrored`.

  Attributes:
    communication: collective implementation: `auto`, `ring`, `nccl`.
    cluster_resolver: `tf_config`, `slurm`, or a `ClusterResolver`.
  """
  communication: str = "auto"
  cluster_resolver: Any = "tf_config"

  def __post_init__(self):
    checks.check_choice("communication", self.communication,
                        COMMUNICATION_CHOICES)


@dataclasses.dataclass(frozen=True)
class ParameterServerOptions:
  """Options of `parameter_server`.

  Attributes:
    cluster_resolver: `tf_config`, `slurm`, or a `ClusterResolver`.
    variable_shards: split each variable over this many parameter servers
      (`FixedShardsPartitioner`); `None` keeps variables whole.
  """
  cluster_resolver: Any = "tf_config"
  variable_shards: int | None = None

  def __post_init__(self):
    checks.check_positive("variable_shards", self.variable_shards,
                          allow_none=True)


@dataclasses.dataclass(frozen=True)
class CentralStorageOptions(DeviceOptions):
  """Options of `central_storage`: the replica devices and
  `parameter_device`, where the variables live (default `/cpu:0`)."""
  parameter_device: str | None = None


@dataclasses.dataclass(frozen=True)
class TpuOptions:
  """Options of `tpu`: `tpu`, the TPU's name or address (`""`: this VM's)."""
  tpu: str = ""


# ------------------------------------------------------------ registry

@registry.register
class Default(DataParallel):
  """TF's default strategy: no distribution."""
  name = "default"
  description = "No distribution: TF's default strategy on the default device."
  needs = "nothing"
  concurrent_devices = False

  def make_strategy(self, options: Any) -> "tf.distribute.Strategy":
    return tf.distribute.get_strategy()


@registry.register
class OneDevice(DataParallel):
  """`OneDeviceStrategy` on one chosen device."""
  name = "one_device"
  description = "Everything on one chosen device (first GPU, else CPU)."
  needs = "one device"
  Options = OneDeviceOptions
  concurrent_devices = False

  def make_strategy(self, options: OneDeviceOptions) -> "tf.distribute.Strategy":
    dev = (devices_lib.resolve_devices(options.devices)[0] if options.devices
           else devices_lib.accelerator_devices()[0])
    return tf.distribute.OneDeviceStrategy(dev)


@registry.register
class Mirrored(DataParallel):
  """`MirroredStrategy` over the devices of one host."""
  name = "mirrored"
  description = ("Synchronous data parallelism over the devices of one host "
                 "(all-reduce of gradients).")
  needs = "2+ GPUs, or logical CPUs for testing"
  Options = MirroredOptions

  def check_config(self, config: Any) -> None:
    _check_batch_over_virtual_devices(self.name, config)

  def make_strategy(self, options: MirroredOptions) -> "tf.distribute.Strategy":
    replicas = _replica_devices(options.devices, options.num_gpus,
                                options.num_replicas)
    if (len(replicas) == 1 and options.single_replica == "default"
        and replicas[0] == devices_lib.accelerator_devices()[0]):
      # One replica on the default device: the default strategy does the
      # same work without MirroredStrategy's per-step wrapping.
      logging.info("mirrored: one replica on %s, using the default strategy "
                   "(single_replica='mirrored' keeps MirroredStrategy).",
                   replicas[0])
      return tf.distribute.get_strategy()
    ops = make_cross_device_ops(options.cross_device_ops, replicas,
                                options.num_packs)
    return tf.distribute.MirroredStrategy(replicas, cross_device_ops=ops)

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    layout = devices_lib.current_layout()
    if not layout.gpus and len(layout.cpus) == 1:
      logging.warning(
          "No GPU found: 'mirrored' trains one replica on the CPU. To "
          "simulate N devices, add --virtual_devices=N (Python: "
          "tfmgpu.configure_devices(logical_cpus=N) before any TF work).")
    return super().place(options, build, strategy=strategy, seed=seed)


def _check_batch_over_virtual_devices(name: str, config: Any) -> None:
  """The global batch must divide by the replicas the config chooses (known
  before TensorFlow loads when they are counted, not found)."""
  if config.num_replicas:
    n, why = config.num_replicas, ""
  elif config.devices:
    n, why = len(config.devices), ""
  elif config.virtual_devices and config.num_gpus is None:
    n, why = config.virtual_devices, f" (virtual_devices={config.virtual_devices})"
  else:
    return
  checks.check_divisible("global_batch_size", config.global_batch_size, n,
                         f"the {n} replicas of {name!r}{why}")


@registry.register
class MultiWorkerMirrored(DataParallel):
  """`MultiWorkerMirroredStrategy` on TF's collective runtime.

  Create it before any other TensorFlow work in the process (it configures
  collective ops, which TF allows only at program startup). Train with
  `tfmgpu.Trainer`: Keras 3.15 `model.fit` is broken under this strategy
  (keras-team/keras#20585). On CPU-only hosts TF uses one replica per worker
  (CPU:0), whatever `--virtual_devices` says; GPUs give one replica per
  (logical) GPU.
  """
  name = "multi_worker_mirrored"
  description = ("Synchronous data parallelism across hosts on TF's "
                 "collective runtime (TF_CONFIG or SLURM).")
  needs = "TF_CONFIG or a SLURM job; one process per host"
  Options = MultiWorkerOptions
  joins_cluster = True

  def make_strategy(self, options: MultiWorkerOptions
                    ) -> "tf.distribute.Strategy":
    if (options.communication == "nccl"
        and not tf.config.list_physical_devices("GPU")):
      raise ValueError("communication='nccl' needs GPUs and this host has "
                       "none; use communication='ring' or 'auto'.")
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(
            tf.distribute.experimental.CommunicationImplementation,
            options.communication.upper()))
    resolver = resolvers.make_resolver(options.cluster_resolver)
    try:
      strategy = tf.distribute.MultiWorkerMirroredStrategy(
          cluster_resolver=resolver, communication_options=comm)
    except RuntimeError as e:
      if "program startup" not in str(e):
        raise
      raise RuntimeError(
          "strategy 'multi_worker_mirrored' must be created before "
          "TensorFlow starts its runtime in this process: it configures "
          f"collective ops for the cluster (task {resolver.task_type}:"
          f"{resolver.task_id}), which TF allows only at program startup "
          f"({e}). Create it first, right after tfmgpu.configure_devices(...) "
          "and before any other TF op (tfmgpu.run_training does this); in a "
          "notebook, restart the kernel.") from e
    if strategy.extended._in_multi_worker_mode():  # pylint: disable=protected-access
      logging.info("multi_worker_mirrored: train with tfmgpu's Trainer; Keras "
                   "3.15 model.fit is broken under this strategy "
                   "(keras-team/keras#20585).")
    return strategy


@registry.register
class ParameterServer(DataParallel):
  """`ParameterServerStrategy`, for the coordinator (the "chief" task).

  The "ps" and "worker" tasks only run servers (`tfmgpu.cluster.run_server`).
  Keras 3 `model.fit` does not support this strategy: train with
  `tfmgpu.training.parameter_server.ParameterServerTrainer`.
  """
  name = "parameter_server"
  description = ("Asynchronous training with variables on parameter servers, "
                 "driven by a coordinator.")
  needs = "a cluster with 'ps' and 'worker' jobs (TF_CONFIG)"
  Options = ParameterServerOptions
  joins_cluster = True

  def make_strategy(self, options: ParameterServerOptions
                    ) -> "tf.distribute.Strategy":
    resolver = resolvers.make_resolver(options.cluster_resolver)
    spec = resolver.cluster_spec().as_dict()
    missing = [j for j in ("ps", "worker") if not spec.get(j)]
    if missing:
      raise ValueError(
          f"parameter_server needs a cluster with 'ps' and 'worker' jobs; the "
          f"cluster ({spec or 'empty: TF_CONFIG is unset'}) lacks "
          f"{', '.join(missing)}. Start one with "
          "scripts/launch_local_cluster.py --num_ps=1, or set TF_CONFIG.")
    shards = options.variable_shards
    partitioner = (tf.distribute.experimental.partitioners
                   .FixedShardsPartitioner(shards) if shards else None)
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner)


@registry.register
class CentralStorage(DataParallel):
  """`CentralStorageStrategy`: variables on one device, compute replicated."""
  name = "central_storage"
  description = ("Data parallelism with variables kept on one device (the "
                 "CPU) and compute replicated.")
  needs = "2+ GPUs (or logical CPUs)"
  Options = CentralStorageOptions

  def check_config(self, config: Any) -> None:
    _check_batch_over_virtual_devices(self.name, config)

  def make_strategy(self, options: CentralStorageOptions
                    ) -> "tf.distribute.Strategy":
    replicas = _replica_devices(options.devices, options.num_gpus,
                                options.num_replicas)
    param = devices_lib.resolve_devices(
        [options.parameter_device or "/cpu:0"])[0]
    return tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=replicas, parameter_device=param)


@registry.register
class Tpu(DataParallel):
  """`TPUStrategy` on a TPU slice."""
  name = "tpu"
  description = "Data parallelism on a TPU slice."
  needs = "a TPU (Cloud TPU VM or named TPU)"
  Options = TpuOptions

  def make_strategy(self, options: TpuOptions) -> "tf.distribute.Strategy":
    tpu = options.tpu
    try:
      resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
      tf.config.experimental_connect_to_cluster(resolver)
      tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
      raise ValueError(
          f"strategy 'tpu' found no TPU (tpu={tpu!r}): "
          f"{str(e).splitlines()[0]} Run on a TPU VM or pass tpu='<name>'; on "
          "other machines use 'mirrored'.") from e
    return tf.distribute.TPUStrategy(resolver)
