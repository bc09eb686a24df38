"""This task's role in a cluster, checked before training; ps/worker servers.

`python -m tfmgpu.train` runs the same command in every task of a cluster
(`python -m tfmgpu.launch` starts them locally). `preflight` reads
TF_CONFIG before TensorFlow loads, checks it against the strategy, and says
what this task does:

* `multi_worker_mirrored`: every task ("chief"/"worker") trains in lockstep;
  the chief (else worker 0) writes checkpoints, summaries and model.keras.
* `multi_worker_mirrored --zero_stage=N`: the chief (else worker 0)
  drives every task's devices (in-graph); the others serve it
  (`serves_in_graph`, `tfmgpu.in_graph.serve`).
* `parameter_server`: the "ps" and "worker" tasks run a
  `tf.distribute.Server` until they are stopped (`run_server_if_needed`);
  the "chief" task is the coordinator that runs the training.

Bad input fails here, with exit code 1 from the CLI: malformed TF_CONFIG, a
task index out of range, a cluster that does not fit the strategy, or this
task's own port already in use.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

from absl import logging

from tfmgpu import ports
from tfmgpu import strategies as strategies_lib
from tfmgpu.ports import PortInUseError

# Inter-op threads of a ps/worker server: with 2, a worker can deadlock
# (a scheduled function waits on ops that need another inter-op thread).
SERVER_INTER_OP_THREADS = 4


@dataclasses.dataclass(frozen=True)
class TaskRole:
  """What this process is in its cluster.

  Attributes:
    task_type: "chief", "worker" or "ps"; `None` outside a TF_CONFIG cluster
      (one process, or a SLURM job whose resolver TF builds itself).
    index: the task's index in its job.
    cluster: the cluster spec, e.g. `{"worker": ["host:port", ...]}`.
  """
  task_type: str | None = None
  index: int = 0
  cluster: dict[str, list[str]] = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    """`"worker:1"`, or `"local"` outside a cluster."""
    return f"{self.task_type}:{self.index}" if self.task_type else "local"

  @property
  def address(self) -> str | None:
    """This task's `host:port` in TF_CONFIG."""
    if not self.task_type:
      return None
    return self.cluster[self.task_type][self.index]

  @property
  def runs_server(self) -> bool:
    """True for "ps" and "worker" tasks of a parameter-server cluster."""
    return "ps" in self.cluster and self.task_type in ("ps", "worker")


@dataclasses.dataclass(frozen=True)
class ClusterTarget:
  """What a run asks of its cluster (`TrainConfig.cluster_target`).

  Attributes:
    distribution: the run's resolved strategy or placement.
    cluster_resolver: where a joining strategy's cluster comes from:
      `"tf_config"` or `"slurm"`.
    in_graph: the chief drives every task's devices; the other tasks only
      serve (`tfmgpu.in_graph`: `multi_worker_mirrored --zero_stage=N`).
  """
  distribution: strategies_lib.Distribution
  cluster_resolver: str = "tf_config"
  in_graph: bool = False


def writes_outputs(role: TaskRole, target: ClusterTarget,
                   environ: Mapping[str, str] | None = None) -> bool:
  """Whether this task owns the run's outputs: checkpoints, model.keras, and
  the run directory's lock and record (`tfmgpu.rundir`).

  The only process; the "chief", or worker 0 of a cluster without one; under
  `cluster_resolver='slurm'` (no TF_CONFIG), SLURM task 0.
  """
  if role.task_type:
    if "chief" in role.cluster:
      return role.task_type == "chief"
    return role.task_type == "worker" and role.index == 0
  environ = os.environ if environ is None else environ
  if (target.cluster_resolver == "slurm"
      and target.distribution.joins_cluster):
    return environ.get("SLURM_PROCID", "0") == "0"
  return True


def task_role(tf_config: str | None) -> TaskRole:
  """Parses a TF_CONFIG value (`None` or empty: no cluster).

  Raises:
    ValueError: malformed JSON, no cluster, or a task index out of range.
  """
  if not tf_config:
    return TaskRole()
  cfg = strategies_lib.validate_tf_config(tf_config)
  task = cfg.get("task") or {}
  if not task.get("type"):
    raise ValueError(
        f"TF_CONFIG has a cluster but no task: add e.g. \"task\": {{\"type\": "
        f"\"worker\", \"index\": 0}} naming this process's place in "
        f"{describe_jobs(cfg['cluster'])}.")
  cluster = {job: list(addrs) for job, addrs in cfg["cluster"].items()}
  return TaskRole(task["type"], task.get("index", 0), cluster)


def describe_jobs(cluster: Mapping[str, Any]) -> str:
  """`"chief: 1, worker: 2, ps: 1"` for messages."""
  return ", ".join(f"{job}: {len(addrs)}" for job, addrs in cluster.items())


def check_port_free(role: TaskRole) -> None:
  """Checks that this task's own port can be bound (TF's server listens on it).

  Raises:
    PortInUseError: another process listens on the port, or it is invalid.
  """
  host, sep, port_text = (role.address or "").rpartition(":")
  if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
    raise PortInUseError(
        f"TF_CONFIG gives task {role.name} the address {role.address!r}, "
        "which has no valid port. Use 'host:port', e.g. '10.0.0.2:2222'.")
  port = int(port_text)
  with socket.socket(ports.address_family(host), socket.SOCK_STREAM) as sock:
    # Like gRPC, reuse a port whose old connections linger in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      sock.bind(("", port))
    except OSError as e:
      raise PortInUseError(
          f"TF_CONFIG gives task {role.name} the address {role.address}, but "
          f"port {port} cannot be bound on this machine ({e.strerror}): "
          "another process is using it. Stop that process (see `ss -ltnp "
          f"'sport = :{port}'`), or give this task a free port in TF_CONFIG "
          "(python -m tfmgpu.launch picks free ports).") from e


def preflight(target: ClusterTarget,
              environ: Mapping[str, str] | None = None) -> TaskRole:
  """Checks the cluster against the run's strategy before TensorFlow loads.

  Args:
    target: the run's strategy and cluster resolver
      (`TrainConfig.cluster_target`).
    environ: where TF_CONFIG is read. Defaults to `os.environ`.

  Returns:
    This task's `TaskRole`.

  Raises:
    ValueError: malformed TF_CONFIG, task index out of range, a cluster that
      does not fit the strategy, or (`PortInUseError`) this task's port is
      taken.
  """
  environ = os.environ if environ is None else environ
  distribution = target.distribution
  name = distribution.name
  if distribution.joins_cluster and target.cluster_resolver == "slurm":
    if not distribution.slurm:
      raise ValueError(
          f"strategy={name!r} with cluster_resolver='slurm' is not supported: "
          f"SLURM gives every task the same role. Describe the "
          f"{_jobs(distribution.required_jobs, 'and')} tasks in TF_CONFIG "
          "(cluster_resolver='tf_config').")
    return TaskRole()  # SlurmClusterResolver checks the SLURM job itself.
  role = task_role(environ.get("TF_CONFIG"))
  if not role.task_type:
    if distribution.required_jobs:
      raise ValueError(
          f"strategy={name!r} needs a cluster with "
          f"{_jobs(distribution.required_jobs, 'and')} tasks in TF_CONFIG, "
          "which is unset. Start one with python -m tfmgpu.launch "
          "--num_workers=2 --num_ps=1 --coordinator -- python -m "
          f"tfmgpu.train --strategy={name}")
    if distribution.joins_cluster:
      logging.warning(
          "strategy=%r without TF_CONFIG or a SLURM job: this process trains "
          "alone, as one worker. On a cluster, set TF_CONFIG in every task "
          "(python -m tfmgpu.launch does) or use --cluster_resolver=slurm.",
          name)
    return role
  _check_jobs(role, distribution)
  check_port_free(role)
  return role


def _jobs(jobs, conjunction: str, roles: Mapping[str, str] | None = None
          ) -> str:
  """`'chief' (the coordinator), 'worker' and 'ps'` for messages."""
  roles = roles or {}
  quoted = [f"{j!r} ({roles[j]})" if j in roles else repr(j) for j in jobs]
  if len(quoted) < 2:
    return "".join(quoted)
  return f"{', '.join(quoted[:-1])} {conjunction} {quoted[-1]}"


def _strategy_for(jobs) -> str:
  """The joining strategy with the fewest jobs that covers `jobs`."""
  fits = [d for d in strategies_lib.registered().values()
          if d.joins_cluster and set(jobs) <= set(d.cluster_jobs)]
  return min(fits, key=lambda d: len(d.cluster_jobs)).name if fits else ""


def _check_jobs(role: TaskRole, distribution: Any) -> None:
  """Checks that the jobs of `role.cluster` are the ones `distribution` runs.

  Raises:
    ValueError: the strategy trains on one host, the cluster has a job the
      strategy does not use, or lacks one it needs.
  """
  name = distribution.name
  if not distribution.joins_cluster:
    raise ValueError(
        f"TF_CONFIG puts this process in a cluster (task {role.name}; "
        f"{describe_jobs(role.cluster)}) but strategy={name!r} trains on "
        f"one host, so every task would train alone. Use "
        f"--strategy={_strategy_for(role.cluster)}, or unset TF_CONFIG.")
  allowed = distribution.cluster_jobs
  extra = [job for job in role.cluster if job not in allowed]
  if extra:
    other = _strategy_for(role.cluster)
    hint = (f"use --strategy={other} for a cluster with {_jobs(extra, 'and')}"
            f" tasks" if other else "tfmgpu.train runs only these jobs")
    raise ValueError(
        f"TF_CONFIG has job(s) {', '.join(map(repr, extra))}, which "
        f"strategy={name!r} does not use (it takes "
        f"{', '.join(map(repr, allowed))}): {hint}.")
  missing = [job for job in distribution.required_jobs
             if job not in role.cluster]
  if missing:
    needs = _jobs(distribution.required_jobs, "and", distribution.job_roles)
    raise ValueError(
        f"strategy={name!r} needs {needs} tasks; TF_CONFIG's cluster "
        f"({describe_jobs(role.cluster)}) lacks "
        f"{', '.join(map(repr, missing))}. With the launcher: --num_ps=1 "
        "--coordinator.")


def run_server(role: TaskRole, *,
               inter_op_threads: int = SERVER_INTER_OP_THREADS) -> None:
  """Runs this task's `tf.distribute.Server` until the process is stopped."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if inter_op_threads < 4:
    raise ValueError(f"inter_op_threads={inter_op_threads}: parameter-server "
                     "workers can deadlock with fewer than 4. Use >= 4.")
  server = tf.distribute.Server(
      tf.train.ClusterSpec(role.cluster), job_name=role.task_type,
      task_index=role.index, protocol="grpc",
      config=tf.compat.v1.ConfigProto(
          inter_op_parallelism_threads=inter_op_threads),
      start=True)
  logging.info("Task %s serves at %s for the coordinator; it runs until "
               "stopped.", role.name, role.address)
  server.join()


def serves_in_graph(role: TaskRole, target: ClusterTarget) -> bool:
  """Whether this task only serves the chief's in-graph run: a task of a
  TF_CONFIG cluster that does not write the outputs."""
  return bool(target.in_graph and role.task_type
              and not writes_outputs(role, target))


def run_server_if_needed(role: TaskRole) -> None:
  """Serves forever if this is a ps/worker task of a parameter-server cluster.

  Returns only for tasks that train (the coordinator, multi-worker mirrored
  workers, or a single process).
  """
  if role.runs_server:
    run_server(role)
