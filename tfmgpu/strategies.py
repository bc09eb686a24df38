"""The strategy registry and `get_strategy()`.

Every way tfmgpu spreads work over devices is registered here under a name
with a one-line description; this registry is the only list of names (the
CLI's `--strategy` choices come from it). Data-parallel names build a genuine
`tf.distribute.Strategy`. Placement names (model, pipeline and branch
parallelism, registered by `tfmgpu.parallel`) describe how a model is split;
for them `get_strategy` returns the default strategy, which is what their
stages run under.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Callable, Sequence

from absl import logging

from tfmgpu._lazy import LazyModule

# The CLIs import this module to list `--strategy` choices, and `--help` must
# answer before TensorFlow loads: TensorFlow is imported on first use.
tf = LazyModule("tensorflow")
devices_lib = LazyModule("tfmgpu.devices")


class Kind(str, enum.Enum):
  """How a registered name spreads work."""
  DATA_PARALLEL = "data_parallel"    # Replicas of the whole model.
  PLACEMENT = "placement"            # The model itself is split over devices.


@dataclasses.dataclass(frozen=True)
class StrategyEntry:
  """One registered name.

  Attributes:
    name: the registry key (`--strategy` value).
    description: one line for help text and docs.
    kind: `Kind.DATA_PARALLEL` or `Kind.PLACEMENT`.
    builder: for data-parallel names, `builder(**options)` returns a
      `tf.distribute.Strategy`; for placements, `None`.
    needs: what it needs to run, for the docs' strategy table.
    joins_cluster: the strategy reads a cluster (TF_CONFIG or SLURM) and
      must be created before TensorFlow's runtime starts in the process.
    concurrent_devices: its devices compute at the same time (replicas,
      pipeline stages, branches), so a CPU split into logical devices gives
      each op only its share of the cores (`devices.configure_devices`).
  """
  name: str
  description: str
  kind: Kind
  builder: Callable[..., tf.distribute.Strategy] | None
  needs: str = ""
  joins_cluster: bool = False
  concurrent_devices: bool = True


_REGISTRY: dict[str, StrategyEntry] = {}


def register_strategy(name: str, description: str, *,
                      kind: Kind = Kind.DATA_PARALLEL, needs: str = "",
                      joins_cluster: bool = False,
                      concurrent_devices: bool = True):
  """Decorator (or plain call with `builder=None`) that registers a name."""
  def decorate(builder):
    if name in _REGISTRY:
      raise ValueError(f"strategy name {name!r} is already registered.")
    _REGISTRY[name] = StrategyEntry(name, description, kind, builder, needs,
                                    joins_cluster, concurrent_devices)
    return builder
  return decorate


def register_placement(name: str, description: str, *, needs: str = "",
                       concurrent_devices: bool = True) -> None:
  """Registers a placement (model/pipeline/branch parallel) name."""
  register_strategy(name, description, kind=Kind.PLACEMENT, needs=needs,
                    concurrent_devices=concurrent_devices)(None)


def intra_op_threads_for(name: str) -> int | None:
  """`intra_op_threads` for `devices.configure_devices` when running `name`:
  `None` (share the cores) if its devices compute at once, else `0` (leave
  TensorFlow's setting: every core per op)."""
  return None if strategy_entry(name).concurrent_devices else 0


def available_strategies() -> dict[str, str]:
  """Returns `{name: one-line description}` for every registered name."""
  return {n: e.description for n, e in _REGISTRY.items()}


def strategy_entry(name: str) -> StrategyEntry:
  """Looks up a registered name.

  Raises:
    ValueError: unknown name, listing the available ones.
  """
  if name not in _REGISTRY:
    raise ValueError(
        f"Unknown strategy name={name!r}. Available names: "
        f"{', '.join(sorted(_REGISTRY))}.")
  return _REGISTRY[name]


def get_strategy(name: str = "default", **options: Any) -> tf.distribute.Strategy:
  """Builds the strategy registered under `name`.

  Never returns `None`: "no distribution" is the default strategy, so every
  caller can write `with strategy.scope():`.

  Args:
    name: a registered name; see `available_strategies()`.
    **options: options of that strategy, e.g. `devices`, `num_gpus`,
      `num_replicas`, `cross_device_ops`, `num_packs` for `mirrored`;
      `communication`, `cluster_resolver` for `multi_worker_mirrored`.

  Returns:
    A `tf.distribute.Strategy`.

  Raises:
    ValueError: unknown name or option, or a choice that cannot work here
      (NCCL without GPUs, more GPUs than exist, TPU without a TPU).
  """
  entry = strategy_entry(name)
  if entry.kind is Kind.PLACEMENT:
    if options:
      raise ValueError(
          f"strategy {name!r} is a placement of the model, not a "
          f"tf.distribute.Strategy; options {sorted(options)} belong to "
          "tfmgpu.parallel (e.g. tfmgpu.StagedModel / tfmgpu.plan_stages).")
    return tf.distribute.get_strategy()
  try:
    strategy = entry.builder(**options)
  except TypeError as e:
    if "unexpected keyword" not in str(e):
      raise
    import inspect  # pylint: disable=g-import-not-at-top
    accepted = [p for p in inspect.signature(entry.builder).parameters]
    raise ValueError(
        f"strategy {name!r} got an unknown option ({e}). Its options: "
        f"{', '.join(accepted) or 'none'}.") from None
  logging.info("Strategy %r: %d replica(s).", name, strategy.num_replicas_in_sync)
  return strategy


# --------------------------------------------------------------- devices

def _replica_devices(devices: Sequence[str] | None, num_gpus: int | None,
                     num_replicas: int | None) -> list[str]:
  """Chooses the devices a data-parallel strategy replicates over."""
  given = [o for o, v in (("devices", devices), ("num_gpus", num_gpus),
                          ("num_replicas", num_replicas)) if v is not None]
  if len(given) > 1:
    raise ValueError(f"Pass only one of {given}: they all choose devices.")
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
  if name not in CROSS_DEVICE_OPS_CHOICES:
    raise ValueError(f"cross_device_ops={name!r} is unknown. Choose one of "
                     f"{', '.join(CROSS_DEVICE_OPS_CHOICES)}.")
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


# ------------------------------------------------------ cluster resolvers

def _tf_config_resolver():
  raw = os.environ.get("TF_CONFIG")
  if raw:
    validate_tf_config(raw)
  return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def _slurm_resolver():
  if "SLURM_JOB_ID" not in os.environ:
    raise ValueError(
        "cluster_resolver='slurm' but no SLURM job is visible (SLURM_JOB_ID is "
        "unset). Run under srun/sbatch, or use cluster_resolver='tf_config'.")
  if tf.config.list_physical_devices("GPU"):
    return tf.distribute.cluster_resolver.SlurmClusterResolver()
  return _cpu_slurm_resolver()


def _cpu_slurm_resolver():
  """`SlurmClusterResolver` for nodes without GPUs.

  TF's resolver gives each task its own GPUs, so on a node without any it
  resolves no task at all (or fails looking for nvidia-smi). Here each task
  gets one placeholder GPU slot that is never used: CUDA_VISIBLE_DEVICES is
  left alone and `num_accelerators()` reports none, so each task trains on
  its CPU.
  """

  class CpuSlurmClusterResolver(
      tf.distribute.cluster_resolver.SlurmClusterResolver):

    def num_accelerators(self, task_type=None, task_id=None,
                         config_proto=None):
      del task_type, task_id, config_proto
      return {}

  tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS")
              or os.environ.get("SLURM_NTASKS") or 1)
  return CpuSlurmClusterResolver(gpus_per_node=tasks, gpus_per_task=1,
                                 auto_set_gpu=False)


CLUSTER_RESOLVERS: dict[str, Callable[[], Any]] = {
    "tf_config": _tf_config_resolver,
    "slurm": _slurm_resolver,
}


def validate_tf_config(raw: str) -> dict[str, Any]:
  """Parses and checks a `TF_CONFIG` value.

  Raises:
    ValueError: malformed JSON, missing `cluster`/`task`, or a task index
      outside its job.
  """
  try:
    cfg = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}") from e
  if not isinstance(cfg, dict) or not isinstance(cfg.get("cluster"), dict):
    raise ValueError(
        f"TF_CONFIG needs a 'cluster' object mapping job names to address "
        f"lists; got {raw[:200]!r}.")
  task = cfg.get("task") or {}
  job, index = task.get("type"), task.get("index", 0)
  if job is not None:
    if job not in cfg["cluster"]:
      raise ValueError(f"TF_CONFIG task type {job!r} is not a job of the "
                       f"cluster ({', '.join(cfg['cluster'])}).")
    n = len(cfg["cluster"][job])
    if not isinstance(index, int) or not 0 <= index < n:
      raise ValueError(f"TF_CONFIG task index {index!r} is out of range: job "
                       f"{job!r} has {n} task(s) (indices 0..{n - 1}).")
  return cfg


def _resolver(cluster_resolver: str | Any):
  if not isinstance(cluster_resolver, str):
    return cluster_resolver  # A ClusterResolver object passed through.
  if cluster_resolver not in CLUSTER_RESOLVERS:
    raise ValueError(f"cluster_resolver={cluster_resolver!r} is unknown. Choose "
                     f"one of {', '.join(CLUSTER_RESOLVERS)}.")
  return CLUSTER_RESOLVERS[cluster_resolver]()


# ------------------------------------------------------------- registry

@register_strategy("default", "No distribution: TF's default strategy on the "
                   "default device.", needs="nothing", concurrent_devices=False)
def _default() -> tf.distribute.Strategy:
  return tf.distribute.get_strategy()


@register_strategy("one_device", "Everything on one chosen device (first GPU, "
                   "else CPU).", needs="one device", concurrent_devices=False)
def _one_device(devices: Sequence[str] | None = None) -> tf.distribute.Strategy:
  if devices is not None and len(devices) != 1:
    raise ValueError(f"one_device takes exactly one device; got devices="
                     f"{list(devices)}. Use 'mirrored' for several.")
  dev = (devices_lib.resolve_devices(devices)[0] if devices
         else devices_lib.accelerator_devices()[0])
  return tf.distribute.OneDeviceStrategy(dev)


SINGLE_REPLICA_CHOICES = ("default", "mirrored")


@register_strategy("mirrored", "Synchronous data parallelism over the devices "
                   "of one host (all-reduce of gradients).",
                   needs="2+ GPUs, or logical CPUs for testing")
def _mirrored(devices: Sequence[str] | None = None, num_gpus: int | None = None,
              num_replicas: int | None = None, cross_device_ops: str = "auto",
              num_packs: int = 1, single_replica: str = "default"
              ) -> tf.distribute.Strategy:
  if single_replica not in SINGLE_REPLICA_CHOICES:
    raise ValueError(f"single_replica={single_replica!r} is unknown. Choose "
                     f"one of {', '.join(SINGLE_REPLICA_CHOICES)}.")
  replicas = _replica_devices(devices, num_gpus, num_replicas)
  if (len(replicas) == 1 and single_replica == "default"
      and replicas[0] == devices_lib.accelerator_devices()[0]):
    # One replica on the default device: the default strategy does the same
    # work without MirroredStrategy's per-step wrapping (~10% on small steps).
    logging.info("mirrored: one replica on %s, using the default strategy "
                 "(single_replica='mirrored' keeps MirroredStrategy).",
                 replicas[0])
    return tf.distribute.get_strategy()
  ops = make_cross_device_ops(cross_device_ops, replicas, num_packs)
  return tf.distribute.MirroredStrategy(replicas, cross_device_ops=ops)


COMMUNICATION_CHOICES = ("auto", "ring", "nccl")


@register_strategy("multi_worker_mirrored", "Synchronous data parallelism "
                   "across hosts on TF's collective runtime (TF_CONFIG or SLURM).",
                   needs="TF_CONFIG or a SLURM job; one process per host",
                   joins_cluster=True)
def _multi_worker_mirrored(communication: str = "auto",
                           cluster_resolver: str | Any = "tf_config",
                           ) -> tf.distribute.Strategy:
  """MultiWorkerMirroredStrategy over the cluster of `cluster_resolver`.

  Create it before any other TensorFlow work in the process (it configures
  collective ops, which TF allows only at program startup). Train with
  `tfmgpu.training.loop.Trainer`: Keras 3.15 `model.fit` is broken under
  this strategy (keras-team/keras#20585). On CPU-only hosts TF uses one
  replica per worker (CPU:0), whatever `--virtual_devices` says; GPUs give
  one replica per (logical) GPU.
  """
  if communication not in COMMUNICATION_CHOICES:
    raise ValueError(f"communication={communication!r} is unknown. Choose one of "
                     f"{', '.join(COMMUNICATION_CHOICES)}.")
  if communication == "nccl" and not tf.config.list_physical_devices("GPU"):
    raise ValueError("communication='nccl' needs GPUs and this host has none; "
                     "use communication='ring' or 'auto'.")
  options = tf.distribute.experimental.CommunicationOptions(
      implementation=getattr(
          tf.distribute.experimental.CommunicationImplementation,
          communication.upper()))
  resolver = _resolver(cluster_resolver)
  try:
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options)
  except RuntimeError as e:
    if "program startup" not in str(e):
      raise
    raise RuntimeError(
        "strategy 'multi_worker_mirrored' must be created before TensorFlow "
        "starts its runtime in this process: it configures collective ops for "
        f"the cluster (task {resolver.task_type}:{resolver.task_id}), which TF "
        f"allows only at program startup ({e}). Create it first, right after "
        "tfmgpu.configure_devices(...) and before any other TF op "
        "(tfmgpu.experiment.run_training does this); in a notebook, restart "
        "the kernel.") from e
  if strategy.extended._in_multi_worker_mode():  # pylint: disable=protected-access
    logging.info("multi_worker_mirrored: train with tfmgpu's Trainer; Keras "
                 "3.15 model.fit is broken under this strategy "
                 "(keras-team/keras#20585).")
  return strategy


@register_strategy("parameter_server", "Asynchronous training with variables on "
                   "parameter servers, driven by a coordinator.",
                   needs="a cluster with 'ps' and 'worker' jobs (TF_CONFIG)",
                   joins_cluster=True)
def _parameter_server(cluster_resolver: str | Any = "tf_config",
                      variable_shards: int | None = None,
                      ) -> tf.distribute.Strategy:
  """ParameterServerStrategy, for the coordinator (the "chief" task).

  The "ps" and "worker" tasks only run servers (`tfmgpu.cluster.run_server`).
  Keras 3 `model.fit` does not support this strategy: train with
  `tfmgpu.training.parameter_server.ParameterServerTrainer`.
  """
  resolver = _resolver(cluster_resolver)
  spec = resolver.cluster_spec().as_dict()
  missing = [j for j in ("ps", "worker") if not spec.get(j)]
  if missing:
    raise ValueError(
        f"parameter_server needs a cluster with 'ps' and 'worker' jobs; the "
        f"cluster ({spec or 'empty: TF_CONFIG is unset'}) lacks "
        f"{', '.join(missing)}. Start one with scripts/launch_local_cluster.py "
        "--num_ps=1, or set TF_CONFIG.")
  partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(
      variable_shards) if variable_shards else None)
  return tf.distribute.experimental.ParameterServerStrategy(
      resolver, variable_partitioner=partitioner)


@register_strategy("central_storage", "Data parallelism with variables kept on "
                   "one device (the CPU) and compute replicated.",
                   needs="2+ GPUs (or logical CPUs)")
def _central_storage(devices: Sequence[str] | None = None,
                     num_gpus: int | None = None,
                     num_replicas: int | None = None,
                     parameter_device: str | None = None,
                     ) -> tf.distribute.Strategy:
  replicas = _replica_devices(devices, num_gpus, num_replicas)
  param = devices_lib.resolve_devices([parameter_device or "/cpu:0"])[0]
  return tf.distribute.experimental.CentralStorageStrategy(
      compute_devices=replicas, parameter_device=param)


@register_strategy("tpu", "Data parallelism on a TPU slice.",
                   needs="a TPU (Cloud TPU VM or named TPU)")
def _tpu(tpu: str = "") -> tf.distribute.Strategy:
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except (ValueError, RuntimeError, tf.errors.OpError) as e:
    raise ValueError(
        f"strategy 'tpu' found no TPU (tpu={tpu!r}): {str(e).splitlines()[0]} "
        "Run on a TPU VM or pass tpu='<name>'; on other machines use "
        "'mirrored'.") from e
  return tf.distribute.TPUStrategy(resolver)


# -------------------------------------------------- placements (the model is split)
# Implemented in tfmgpu.parallel; training and inference dispatch on the name.

register_placement(
    "model_parallel",
    "Model parallelism: consecutive layer stages on separate devices, each "
    "stage's forward and backward on its own device (StagedModel).",
    needs="2+ devices (GPUs, or logical CPUs for testing) and a chain-like "
    "Sequential/functional model",
    concurrent_devices=False)  # Stages run one after another.
register_placement(
    "branch_parallel",
    "Parallel sub-models (towers, ensemble members) on separate devices on "
    "the same input, outputs combined (BranchParallel).",
    needs="one device per branch (GPUs, or logical CPUs for testing)")
register_placement(
    "pipeline",
    "Pipeline parallelism: stages on separate devices fed micro-batches "
    "(GPipe or 1F1B schedule), overlapping stages; gradients accumulated and "
    "applied once (PipelinedModel).",
    needs="2+ devices (GPUs, or logical CPUs for testing), a chain-like "
    "Sequential/functional model and a batch divisible by micro_batches")
