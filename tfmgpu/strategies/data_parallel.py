"""The data-parallel distributions: replicas of the whole model.

`default`, `one_device`, `mirrored`, `multi_worker_mirrored`,
`parameter_server`, `central_storage` and `tpu`, each one `Distribution`
(`tfmgpu.strategies.registry`) with its options dataclass
(`tfmgpu.strategies.options`), building a genuine `tf.distribute.Strategy`.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from absl import logging

from tfmgpu import checks
from tfmgpu import in_graph
from tfmgpu import ports
from tfmgpu._lazy import LazyModule
from tfmgpu.strategies import registry
from tfmgpu.strategies import resolvers
from tfmgpu.strategies.options import CentralStorageOptions
from tfmgpu.strategies.options import MirroredOptions
from tfmgpu.strategies.options import MultiWorkerOptions
from tfmgpu.strategies.options import OneDeviceOptions
from tfmgpu.strategies.options import ParameterServerOptions
from tfmgpu.strategies.options import TpuOptions
from tfmgpu.strategies.replicas import in_multi_worker_mode
from tfmgpu.strategies.replicas import make_cross_device_ops
from tfmgpu.strategies.replicas import replica_devices
from tfmgpu.strategies.replicas import select_replica_devices

# The CLIs list the names in `--help` before TensorFlow loads: TensorFlow is
# imported on first use.
tf = LazyModule("tensorflow")
collective_keys = LazyModule("tfmgpu.strategies.collective_keys")
devices_lib = LazyModule("tfmgpu.devices")


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


# ------------------------------------------------------------ sharding

class _Shardable(DataParallel):
  """What `zero_stage` changes in a data-parallel distribution whose model
  then places its own shards (`mirrored`, `multi_worker_mirrored`)."""

  def plan_text(self, model: Any, options: Any, *, global_batch_size: int,
                optimizer: str, input_shape: Any = None) -> str | None:
    """With `zero_stage`: per-device weights, gradients, slots and bytes
    sent, plain mirrored beside the stage; else the stage options' plan."""
    del global_batch_size, input_shape  # Per-device state, not activations.
    if not options.zero_stage:
      return None
    return _sharded_placement("plan_text")(model, options, optimizer)

  def save_model(self, model: Any, path: str) -> str:
    """Saves the whole model (a sharded one gathered first)."""
    return super().save_model(_sharded_placement("unsplit")(model), path)

  def portable(self, options: Any) -> bool:
    """With `zero_stage` the model places itself: its checkpoints carry the
    weights by layer name (a resume may move them into a pipeline)."""
    return bool(options.zero_stage)

  def replicas(self, placement: registry.Placement) -> int:
    """With `zero_stage`, one replica per device (the model places them
    itself, under the default strategy)."""
    if placement.options.zero_stage:
      return len(placement.devices)
    return super().replicas(placement)

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    """Rows: the replicas, and with `zero_stage` what is sharded."""
    stage = placement.options.zero_stage
    if not stage:
      return super().describe(placement)
    sharded = {1: "optimizer slots", 2: "optimizer slots and gradients",
               3: "weights, gradients and optimizer slots"}[stage]
    return [("replicas", f"{len(placement.devices)} on "
             f"{', '.join(placement.devices)}"),
            ("zero", f"stage {stage}: {sharded} sharded over the replicas "
             "(each variable owned by one device, balanced by bytes)")]


_SHARDED_PLACEMENT: dict[str, Callable[..., Any]] = {}


def register_sharded_placement(place: Callable[..., registry.Placement],
                               plan_text: Callable[..., str],
                               unsplit: Callable[[Any], Any]) -> None:
  """Sets how `mirrored --zero_stage=N` places its model,
  `place(distribution, options, build) -> Placement`, what its
  `--plan_only` prints, `plan_text(model, options, optimizer) -> str`, and
  the whole model it saves, `unsplit(model)` (`tfmgpu.placements.sharded`,
  which binds the engine; this layer names none)."""
  _SHARDED_PLACEMENT.update(place=place, plan_text=plan_text,
                            unsplit=unsplit)


def _sharded_placement(what: str) -> Callable[..., Any]:
  if not _SHARDED_PLACEMENT:
    registry.registered()  # Discovers the built-in providers.
  if not _SHARDED_PLACEMENT:
    raise RuntimeError("zero_stage needs tfmgpu.placements.sharded, which "
                       "registers the sharded placement; import tfmgpu.")
  return _SHARDED_PLACEMENT[what]


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
class Mirrored(_Shardable):
  """`MirroredStrategy` over the devices of one host."""
  name = "mirrored"
  description = ("Synchronous data parallelism over the devices of one host "
                 "(all-reduce of gradients).")
  needs = "2+ GPUs, or logical CPUs for testing"
  Options = MirroredOptions

  def check_config(self, options: Any, run: registry.RunFacts) -> None:
    _check_batch_over_virtual_devices(self.name, options, run)

  def make_strategy(self, options: MirroredOptions) -> "tf.distribute.Strategy":
    replicas = select_replica_devices(options.devices, options.num_gpus,
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
    strategy = tf.distribute.MirroredStrategy(replicas, cross_device_ops=ops)
    collective_keys.share(strategy)  # Several in one process stay apart.
    return strategy

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    layout = devices_lib.current_layout()
    if not layout.gpus and len(layout.cpus) == 1:
      logging.warning(
          "No GPU found: 'mirrored' trains one replica on the CPU. To "
          "simulate N devices, give --virtual_devices=N with N >= 2 "
          "(Python: tfmgpu.configure_devices(logical_cpus=N) before any TF "
          "work).")
    if options.zero_stage:  # The model places its own shards.
      return _sharded_placement("place")(self, options, build)
    return super().place(options, build, strategy=strategy, seed=seed)

def _check_batch_over_virtual_devices(name: str, options: Any,
                                      run: registry.RunFacts) -> None:
  """The global batch must divide by the replicas the options choose (known
  before TensorFlow loads when they are counted, not found)."""
  if options.num_replicas:
    n, why = options.num_replicas, ""
  elif options.devices:
    n, why = len(options.devices), ""
  elif run.virtual_devices and options.num_gpus is None:
    n, why = run.virtual_devices, f" (virtual_devices={run.virtual_devices})"
  else:
    return
  checks.check_divisible("global_batch_size", run.global_batch_size, n,
                         f"the {n} replicas of {name!r}{why}")


@registry.register
class MultiWorkerMirrored(_Shardable):
  """`MultiWorkerMirroredStrategy` on TF's collective runtime.

  Create it before any other TensorFlow work in the process (it configures
  collective ops, which TF allows only at program startup). Train with
  `tfmgpu.Trainer`: Keras 3.15 `model.fit` is broken under this strategy
  (keras-team/keras#20585). On CPU-only hosts TF uses one replica per worker
  (CPU:0), whatever `--virtual_devices` says; GPUs give one replica per
  (logical) GPU.

  With `zero_stage` the run is in-graph (`tfmgpu.in_graph`): the chief
  connects to every task and trains a `ShardedModel` over all their
  replica devices under TF's default strategy; the other tasks serve.
  """
  name = "multi_worker_mirrored"
  description = ("Synchronous data parallelism across hosts on TF's "
                 "collective runtime (TF_CONFIG or SLURM).")
  needs = "TF_CONFIG or a SLURM job; one process per host"
  Options = MultiWorkerOptions
  joins_cluster = True
  cluster_jobs = ("chief", "worker")

  def check_config(self, options: Any, run: registry.RunFacts) -> None:
    del run  # The replicas are counted once the cluster is known.
    if options.zero_stage and options.cluster_resolver == "slurm":
      raise ValueError(
          f"zero_stage={options.zero_stage} with cluster_resolver='slurm': "
          "multi-worker ZeRO runs in-graph (the chief drives the other "
          "tasks), which needs each task's role from TF_CONFIG. Set TF_CONFIG "
          "in every task (python -m tfmgpu.launch does), or drop "
          "--zero_stage.")

  def in_graph(self, options: Any) -> bool:
    """With `zero_stage`: the chief drives the other tasks' devices."""
    return bool(options.zero_stage)

  def make_strategy(self, options: MultiWorkerOptions
                    ) -> "tf.distribute.Strategy":
    if options.zero_stage:
      return _connect_in_graph(options)
    if (options.communication == "nccl"
        and not tf.config.list_physical_devices("GPU")):
      raise ValueError("communication='nccl' needs GPUs and this host has "
                       "none; use communication='ring' or 'auto'.")
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(
            tf.distribute.experimental.CommunicationImplementation,
            options.communication.upper()))
    resolver = resolvers.make_resolver(options.cluster_resolver)
    _wait_for_peers(resolver, options.connect_timeout_s)
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
    if in_multi_worker_mode(strategy):
      logging.warning(  # A user's script shows warnings, not info.
          "multi_worker_mirrored: train with tfmgpu's Trainer; Keras 3.15 "
          "model.fit is broken under this strategy (keras-team/keras#20585: "
          "'Attempt to convert a value (PerReplica:...)').")
    return strategy

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    if options.zero_stage:  # Every task's replica devices, in-graph.
      return _sharded_placement("place")(self, options, build,
                                         devices=in_graph.replica_devices())
    return super().place(options, build, strategy=strategy, seed=seed)


def _wait_for_peers(resolver: Any, timeout_s: float) -> None:
  """Every other chief or worker task listens within `timeout_s`, or an
  error naming the missing ones. TensorFlow's own start-up waits for them
  without a bound, silent, in C++ that takes SIGTERM and ignores it; this
  wait is in Python, where SIGTERM and Ctrl-C stop it. Skipped once TF's
  runtime runs (the strategy then refuses, or joins the running cluster)."""
  if devices_lib.runtime_initialized():
    return
  spec = resolver.cluster_spec().as_dict()
  tasks = {}
  for job in MultiWorkerMirrored.cluster_jobs:
    addresses = spec.get(job) or []
    if isinstance(addresses, (list, tuple)):
      addresses = dict(enumerate(addresses))
    tasks.update({f"{job}:{i}": a for i, a in addresses.items()})
  own = tasks.pop(f"{resolver.task_type}:{resolver.task_id}", None)
  if own is None or not tasks:
    return
  ports.require_listening(
      tasks, timeout_s, who="multi_worker_mirrored",
      waiter=f"task {resolver.task_type}:{resolver.task_id}",
      log=logging.warning, listen_on=own)


def _connect_in_graph(options: MultiWorkerOptions) -> "tf.distribute.Strategy":
  """The chief of a multi-worker ZeRO run connects to every task; TF's
  default strategy (the sharded model places its own work). Without a
  cluster, one task alone."""
  resolver = resolvers.make_resolver(options.cluster_resolver)
  cluster = {job: list(tasks) for job, tasks
             in resolver.cluster_spec().as_dict().items()}
  if cluster:
    in_graph.connect(cluster, f"{resolver.task_type}:{resolver.task_id}",
                     timeout_s=options.connect_timeout_s)
  return tf.distribute.get_strategy()


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
  cluster_jobs = ("chief", "worker", "ps")
  required_jobs = ("chief", "worker", "ps")
  slurm = False  # SLURM gives every task the same role.
  job_roles = {"chief": "the coordinator"}
  execution = "coordinator"  # The Trainer's steps are scheduled on workers.

  def make_strategy(self, options: ParameterServerOptions
                    ) -> "tf.distribute.Strategy":
    resolver = resolvers.make_resolver(options.cluster_resolver)
    spec = resolver.cluster_spec().as_dict()
    missing = [j for j in ("ps", "worker") if not spec.get(j)]
    if missing:
      raise ValueError(
          f"parameter_server needs a cluster with 'ps' and 'worker' jobs; the "
          f"cluster ({spec or 'empty: TF_CONFIG is unset'}) lacks "
          f"{', '.join(missing)}. Start one with python -m tfmgpu.launch "
          "--num_workers=2 --num_ps=1 --coordinator -- COMMAND (a script's "
          "ps and worker tasks must serve first: "
          "tfmgpu.cluster.run_server_if_needed), or set TF_CONFIG.")
    ports.require_listening({f"{job}:{i}": address
                             for job in ("ps", "worker")
                             for i, address in enumerate(spec[job])},
                            options.connect_timeout_s,
                            who="parameter_server",
                            waiter="the coordinator", log=logging.info)
    shards = options.variable_shards
    partitioner = (tf.distribute.experimental.partitioners
                   .FixedShardsPartitioner(shards) if shards else None)
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner)

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    """Rows: the workers that run the steps and the ps tasks holding variables.

    Read from the strategy's cluster spec: the coordinator itself computes
    nothing, so its one "replica" would say nothing about the cluster.
    """
    # TF 2.21's ParameterServerStrategy answers `cluster_resolver` with None
    # (the property reads `extended._cluster_resolver`, which it never sets),
    # so a real run printed "replicas 1 on /device:CPU:0"; it keeps the
    # resolver it was given in `_cluster_resolver`.
    strategy = placement.strategy
    resolver = (getattr(strategy, "cluster_resolver", None)
                or getattr(strategy, "_cluster_resolver", None))
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec.get("worker"):
      return super().describe(placement)
    rows = [("workers", f"{len(spec['worker'])} on "
             f"{', '.join(spec['worker'])}")]
    if spec.get("ps"):
      rows.append(("parameter servers",
                   f"{len(spec['ps'])} on {', '.join(spec['ps'])}"))
    return rows


@registry.register
class CentralStorage(DataParallel):
  """`CentralStorageStrategy`: variables on one device, compute replicated."""
  name = "central_storage"
  description = ("Data parallelism with variables kept on one device (the "
                 "CPU) and compute replicated.")
  needs = "2+ GPUs (or logical CPUs)"
  Options = CentralStorageOptions
  keras_fit_caveat = (
      "Keras 3.15's model.fit and model.evaluate under CentralStorageStrategy "
      "report wrong losses and metrics, though they train the right weights "
      "(measured: loss 0.897 against 0.759 on one device, weights 3e-8 "
      "apart); so do Keras metric objects updated inside your own "
      "strategy.run loop (TF's custom-training tutorial: accuracy 0.418 "
      "where 'mirrored' reads 0.449, the loss and weights right). Train and "
      "evaluate with tfmgpu.Trainer(model, strategy=strategy), which reports "
      "what one device does, or use 'mirrored'.")

  def check_config(self, options: Any, run: registry.RunFacts) -> None:
    _check_batch_over_virtual_devices(self.name, options, run)

  def make_strategy(self, options: CentralStorageOptions
                    ) -> "tf.distribute.Strategy":
    replicas = select_replica_devices(options.devices, options.num_gpus,
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
