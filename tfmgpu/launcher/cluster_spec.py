"""The shape of a local cluster: its tasks, their ports and each TF_CONFIG.

`ClusterConfig` validates how many tasks of each type to run and gives them
addresses; `tf_config_for` writes the TF_CONFIG one task reads.

Ports are free when picked (bound on all interfaces, as TF's gRPC server
listens on all of them) but released before the tasks start, so another
program can take one in between; run again if a task reports "address in
use".
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Mapping, Sequence

from tfmgpu import ports
from tfmgpu.ports import PortInUseError

TASK_TYPES = ("chief", "worker", "ps")  # Order of the tasks in a cluster.


def _check_int(name: str, value: int, minimum: int, rule: str) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name}={value!r} is invalid: {rule}. "
                     f"Use an integer >= {minimum}.")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """The shape of a local cluster, validated.

  Attributes:
    num_workers: number of "worker" tasks, at least 1.
    num_ps: number of "ps" (parameter server) tasks. Defaults to `0`.
    chief: whether to add one "chief" task (the parameter-server
      coordinator). Defaults to `False`.
    host: the address tasks use to reach each other. Defaults to
      `"127.0.0.1"`.
    base_port: if set, tasks get consecutive ports from it, in `tasks` order;
      otherwise free ports are picked. Defaults to `None`.
  """
  num_workers: int
  num_ps: int = 0
  chief: bool = False
  host: str = "127.0.0.1"
  base_port: int | None = None

  def __post_init__(self):
    _check_int("num_workers", self.num_workers, 1,
               "a cluster needs at least one worker task")
    _check_int("num_ps", self.num_ps, 0, "it counts parameter-server tasks")
    if not isinstance(self.host, str) or not self.host.strip():
      raise ValueError(f"host={self.host!r} is invalid: give the address the "
                       "tasks use to reach each other, e.g. '127.0.0.1'.")
    if self.base_port is not None:
      last = 65536 - self.num_tasks
      if (isinstance(self.base_port, bool) or
          not isinstance(self.base_port, int) or
          not 1 <= self.base_port <= last):
        raise ValueError(
            f"base_port={self.base_port!r} is invalid: the {self.num_tasks} "
            "tasks need consecutive ports from it within 1..65535. Use a "
            f"base_port in 1024..{last}, or None to pick free ports.")

  @property
  def num_tasks(self) -> int:
    return int(self.chief) + self.num_workers + self.num_ps

  @property
  def tasks(self) -> tuple[tuple[str, int], ...]:
    """`(task_type, index)` of every task: chief, then workers, then ps."""
    counts = {"chief": int(self.chief), "worker": self.num_workers,
              "ps": self.num_ps}
    return tuple((t, i) for t in TASK_TYPES for i in range(counts[t]))

  @property
  def primary_types(self) -> tuple[str, ...]:
    """The task types whose success ends the run; the others are servers."""
    if self.num_ps and self.chief:
      return ("chief",)
    return ("chief", "worker")

  def make_cluster(self) -> dict[str, list[str]]:
    """Picks (or checks) the ports; returns e.g. `{"worker": ["host:port"]}`.

    Raises:
      PortInUseError: a port from `base_port` on cannot be bound.
    """
    family = ports.address_family(self.host)
    host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
    claimed = _claim_ports(self, family)
    cluster: dict[str, list[str]] = {}
    for (task_type, _), port in zip(self.tasks, claimed):
      cluster.setdefault(task_type, []).append(f"{host}:{port}")
    return cluster


def _claim_ports(config: ClusterConfig, family: socket.AddressFamily
                 ) -> list[int]:
  """Binds one port per task at once (so they are distinct), then frees them."""
  sockets = []
  try:
    for i, (task_type, index) in enumerate(config.tasks):
      port = 0 if config.base_port is None else config.base_port + i
      sock = socket.socket(family, socket.SOCK_STREAM)
      sockets.append(sock)
      try:
        sock.bind(("", port))
      except OSError as e:
        if config.base_port is None:
          raise
        raise PortInUseError(
            f"base_port={config.base_port}: port {port} (for task "
            f"{task_type}:{index}) cannot be bound on this machine "
            f"({e.strerror}). Choose another base_port, or leave it unset "
            "to pick free ports automatically.") from e
    return [s.getsockname()[1] for s in sockets]
  finally:
    for sock in sockets:
      sock.close()


def make_cluster(num_workers: int, num_ps: int = 0, chief: bool = False,
                 host: str = "127.0.0.1", base_port: int | None = None
                 ) -> dict[str, list[str]]:
  """Returns a local cluster spec with a free port per task.

  Args:
    num_workers: number of "worker" tasks, at least 1.
    num_ps: number of "ps" tasks. Defaults to `0`.
    chief: whether to add a "chief" task. Defaults to `False`.
    host: address of every task. Defaults to `"127.0.0.1"`.
    base_port: first of consecutive ports to use (chief, workers, then ps);
      each is checked to be free. Defaults to `None`: pick free ports.

  Returns:
    The "cluster" part of TF_CONFIG, e.g.
    `{"worker": ["127.0.0.1:40123", "127.0.0.1:40125"], "ps": [...]}`, with
    only the jobs that have tasks, in the order chief, worker, ps.

  Raises:
    ValueError: an argument is invalid.
    PortInUseError: a port from `base_port` on cannot be bound.
  """
  return ClusterConfig(num_workers, num_ps, chief, host,
                       base_port).make_cluster()


def tf_config_for(cluster: Mapping[str, Sequence[str]], task_type: str,
                  index: int) -> str:
  """Returns the TF_CONFIG JSON of one task of `cluster`.

  Raises:
    ValueError: a job's addresses are not a list of strings (a string would
      give one address per character), `task_type` is not a job of
      `cluster`, or `index` is out of range for it.
  """
  for job, addresses in cluster.items():
    if isinstance(addresses, str) or not all(isinstance(a, str)
                                             for a in addresses):
      raise ValueError(
          f"cluster[{job!r}]={addresses!r} is invalid: give a list of "
          f"'host:port' strings, e.g. {{{job!r}: [{addresses!r}]}}"
          if isinstance(addresses, str) else
          f"cluster[{job!r}]={addresses!r} is invalid: give a list of "
          "'host:port' strings, e.g. ['127.0.0.1:2222'].")
  if task_type not in cluster:
    raise ValueError(f"task_type={task_type!r} is not a job of this cluster. "
                     f"Available: {sorted(cluster)}.")
  n = len(cluster[task_type])
  if (isinstance(index, bool) or not isinstance(index, int) or
      not 0 <= index < n):
    raise ValueError(f"index={index!r} is out of range for "
                     f"task_type={task_type!r}, which has {n} task(s): "
                     f"use 0..{n - 1}.")
  return json.dumps({"cluster": {k: list(v) for k, v in cluster.items()},
                     "task": {"type": task_type, "index": index}})
