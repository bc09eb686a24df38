"""Run a local TensorFlow cluster: a process per task, each with its TF_CONFIG.

`launch` starts one command once per task of a local cluster and supervises
the processes; `scripts/launch_local_cluster.py` is its command line:

    python scripts/launch_local_cluster.py --num_workers=2 -- \\
        python -m tfmgpu.train --strategy=multi_worker_mirrored ...

This module only starts processes: it never imports TensorFlow.

Contract with the command:

* Every task runs the same command with the launcher's environment plus
  `TF_CONFIG`, the JSON TensorFlow's `TFConfigClusterResolver` reads
  (`{"cluster": {"chief": [...], "worker": [...], "ps": [...]},
  "task": {"type": "worker", "index": 0}}`), `TFMGPU_TASK` (the same task as
  `"worker:0"`, for logs) and `PYTHONUNBUFFERED=1` (unless already set) so that
  Python output streams live.
* Multi-worker mirrored (`num_ps=0`): every task trains and must exit 0.
  `chief=True` adds a "chief" task, which TF treats as worker 0.
* Parameter server (`num_ps>0`): the command reads its task type from
  TF_CONFIG. "ps" and "worker" tasks start a `tf.distribute.Server` and join
  it, which never returns; the "chief" task (`chief=True`) is the coordinator
  that runs the training. Servers never exit on their own, so the launcher
  waits only for the tasks that do the work -- the chief if there is one,
  else the workers -- and once all of those have exited 0 it stops the
  remaining (server) tasks with SIGTERM and still reports success.

Lifecycle:

* Each task is the leader of its own process group (a new session), so a
  signal to the task reaches its children too, and a Ctrl-C in the terminal
  reaches only the launcher, which then stops the tasks itself. A task's
  stdout and stderr are merged and printed line by line as `[worker:0] ...`;
  the launcher's own messages start with `[launcher] `.
* The first task to exit non-zero or die by a signal is named, the others get
  SIGTERM, then SIGKILL after `grace_s`. The exit code is that task's code,
  or 128 + the signal number.
* After `timeout_s` everything is stopped the same way; exit code 124.
* SIGINT or SIGTERM to the launcher stops the tasks the same way; exit code
  130 or 143. A second signal skips the rest of the grace period.
* Whatever happens (success, failure, exception), every process group still
  alive at the end is stopped, so no task or child of a task outlives the
  launcher -- unless the launcher itself is killed with SIGKILL.

Ports are free when picked (bound on all interfaces, as TF's gRPC server
listens on all of them) but released before the tasks start, so another
program can take one in between; run again if a task reports "address in
use". POSIX only (process groups).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Mapping, Sequence, TextIO

TASK_TYPES = ("chief", "worker", "ps")  # Order of the tasks in a cluster.
EXIT_TIMEOUT = 124  # As coreutils' `timeout`.

_POLL_S = 0.05
_KILL_WAIT_S = 5.0  # After SIGKILL, how long to wait for the processes to go.
_DRAIN_S = 1.0  # How long to wait for a finished task's last output lines.


class PortInUseError(ValueError):
  """A port the cluster needs cannot be bound on this machine."""


class Outcome(str, enum.Enum):
  """How a launch ended."""
  SUCCEEDED = "succeeded"
  TASK_FAILED = "task_failed"
  TIMED_OUT = "timed_out"
  INTERRUPTED = "interrupted"


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
    family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
    host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
    ports = _claim_ports(self, family)
    cluster: dict[str, list[str]] = {}
    for (task_type, _), port in zip(self.tasks, ports):
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
    ValueError: `task_type` is not a job of `cluster`, or `index` is out of
      range for it.
  """
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


@dataclasses.dataclass(frozen=True)
class LaunchResult:
  """What happened to a launched cluster.

  Attributes:
    exit_code: 0 on success; else the first failed task's exit code (128 +
      signal if it was killed), 124 on timeout, 128 + signal if the launcher
      was interrupted.
    outcome: how the launch ended.
    task_exit_codes: per task name (`"worker:0"`), its exit code in
      `subprocess` form: negative for "killed by signal -code", `None` if it
      could not be reaped.
    first_failure: the task that failed first, or `None`.
    stopped: tasks the launcher stopped while they were still running
      (servers after success, the others after a failure or timeout).
    pids: per task name, its process id (also its process group id).
    cluster: the cluster spec every task saw in TF_CONFIG.
    duration_s: wall time from the first start to the last exit.
  """
  exit_code: int
  outcome: Outcome
  task_exit_codes: dict[str, int | None]
  first_failure: str | None
  stopped: tuple[str, ...]
  pids: dict[str, int]
  cluster: dict[str, list[str]]
  duration_s: float

  @property
  def ok(self) -> bool:
    return self.exit_code == 0


def _describe_exit(code: int | None) -> str:
  """`"exited with code 3"`, `"was killed by signal SIGKILL (9)"`, ..."""
  if code is None:
    return "is still running"
  if code >= 0:
    return f"exited with code {code}"
  try:
    name = signal.Signals(-code).name
  except ValueError:
    name = "unknown"
  return f"was killed by signal {name} ({-code})"


def _group_has_live_process(pgid: int) -> bool:
  """Whether process group `pgid` has a process that is not a zombie."""
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  if not os.path.isdir("/proc"):
    return True
  # killpg also succeeds for zombies, which orphans become when nothing reaps
  # them (e.g. in containers); they hold no resources, so skip them.
  for entry in os.scandir("/proc"):
    if not entry.name.isdigit():
      continue
    try:
      with open(f"/proc/{entry.name}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    state, _, pgrp = stat[stat.rfind(b")") + 2:].split()[:3]
    if int(pgrp) == pgid and state not in (b"Z", b"X"):
      return True
  return False


def _pump(stream, prefix: str, write: Callable[[str], None]) -> None:
  """Copies `stream` to `write` line by line, each line after `prefix`."""
  with stream:
    for raw in iter(stream.readline, b""):
      write(prefix + raw.decode("utf-8", "replace").rstrip("\r\n") + "\n")


class _Task:
  """One started task: its process, output reader and bookkeeping."""

  def __init__(self, name: str, task_type: str, proc: subprocess.Popen,
               reader: threading.Thread):
    self.name, self.type, self.proc, self.reader = name, task_type, proc, reader
    self.stopped = False  # The launcher signalled it while it ran.
    self._group_gone = False

  def running(self) -> bool:
    return self.proc.poll() is None

  def alive(self) -> bool:
    """Whether the task or anything left in its process group still runs."""
    if self.running():
      return True
    if not self._group_gone:
      self._group_gone = not _group_has_live_process(self.proc.pid)
    return not self._group_gone

  def signal(self, sig: int) -> None:
    if self._group_gone:
      return
    try:
      os.killpg(self.proc.pid, sig)
    except ProcessLookupError:
      self._group_gone = self.proc.poll() is not None
    except PermissionError:
      pass


class _Run:
  """The state of one `launch`: tasks, output and received signals."""

  def __init__(self, output: TextIO, grace_s: float):
    self.output = output
    self.grace_s = grace_s
    self.tasks: list[_Task] = []
    self.signals: list[int] = []
    self.first_failure: str | None = None
    self._lock = threading.Lock()

  def write(self, text: str) -> None:
    with self._lock:
      try:
        self.output.write(text)
        self.output.flush()
      except (OSError, ValueError):  # Output closed: keep draining the pipes.
        pass

  def say(self, message: str) -> None:
    self.write(f"[launcher] {message}\n")

  def start(self, command: list[str], config: ClusterConfig,
            cluster: dict[str, list[str]], env: Mapping[str, str]) -> None:
    self.say(f"Starting {config.num_tasks} task(s) on cluster "
             f"{json.dumps(cluster)}.")
    for task_type, index in config.tasks:
      name = f"{task_type}:{index}"
      task_env = dict(env)
      task_env["TF_CONFIG"] = tf_config_for(cluster, task_type, index)
      task_env["TFMGPU_TASK"] = name
      task_env.setdefault("PYTHONUNBUFFERED", "1")
      proc = subprocess.Popen(
          command, env=task_env, stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          start_new_session=True)
      reader = threading.Thread(
          target=_pump, args=(proc.stdout, f"[{name}] ", self.write),
          name=f"tfmgpu-launcher-{name}", daemon=True)
      self.tasks.append(_Task(name, task_type, proc, reader))
      reader.start()

  def running(self) -> list[_Task]:
    return [t for t in self.tasks if t.running()]

  def supervise(self, config: ClusterConfig, timeout_s: float | None,
                started: float) -> tuple[Outcome, int]:
    """Waits until success, a failure, the timeout or a signal; stops tasks."""
    primaries = [t for t in self.tasks if t.type in config.primary_types]
    while True:
      if self.signals:
        sig = self.signals[0]
        self.say(f"Received {signal.Signals(sig).name}; stopping all tasks.")
        self.stop(self.running())
        return Outcome.INTERRUPTED, 128 + sig
      for task in self.tasks:
        code = task.proc.poll()
        if code is not None and code != 0:
          task.reader.join(_DRAIN_S)
          self.first_failure = task.name
          others = self.running()
          self.say(f"Task {task.name} {_describe_exit(code)}." + (
              f" Stopping the other tasks: {_names(others)}." if others
              else ""))
          self.stop(others)
          return Outcome.TASK_FAILED, code if code > 0 else 128 - code
      if all(t.proc.returncode == 0 for t in primaries):
        servers = self.running()
        if servers:
          kinds = sorted({t.type for t in primaries}, key=TASK_TYPES.index)
          self.say(f"All {' and '.join(kinds)} tasks succeeded; stopping "
                   "the server tasks, which never exit on their own: "
                   f"{_names(servers)}.")
          self.stop(servers)
        return Outcome.SUCCEEDED, 0
      if timeout_s is not None and time.monotonic() - started >= timeout_s:
        running = self.running()
        self.say(f"Timed out: timeout_s={timeout_s:g} elapsed with "
                 f"{len(running)} task(s) still running: {_names(running)}. "
                 "Stopping them.")
        self.stop(running)
        return Outcome.TIMED_OUT, EXIT_TIMEOUT
      time.sleep(_POLL_S)

  def stop(self, tasks: Sequence[_Task]) -> None:
    """SIGTERM to the tasks' process groups, SIGKILL after the grace period."""
    tasks = [t for t in tasks if t.alive()]
    if not tasks:
      return
    for task in tasks:
      task.stopped = task.stopped or task.running()
      task.signal(signal.SIGTERM)
    signals_before = len(self.signals)
    deadline = time.monotonic() + self.grace_s
    while (any(t.alive() for t in tasks) and time.monotonic() < deadline and
           len(self.signals) == signals_before):
      time.sleep(_POLL_S)
    left = [t for t in tasks if t.alive()]
    if not left:
      return
    why = ("A second signal arrived" if len(self.signals) > signals_before
           else f"grace_s={self.grace_s:g} elapsed")
    self.say(f"{why} and {_names(left)} still running after SIGTERM; "
             "sending SIGKILL.")
    for task in left:
      task.signal(signal.SIGKILL)
    deadline = time.monotonic() + _KILL_WAIT_S
    while any(t.alive() for t in left) and time.monotonic() < deadline:
      time.sleep(_POLL_S)
    left = [t for t in left if t.alive()]
    if left:
      self.say(f"Could not stop process groups {[t.proc.pid for t in left]} "
               f"({_names(left)}); check them with `ps -g`.")

  def cleanup(self) -> None:
    """Stops whatever still runs (any path), then drains the output."""
    leftovers = [t for t in self.tasks if t.alive()]
    if leftovers:
      self.say(f"Stopping processes still running in: {_names(leftovers)}.")
      self.stop(leftovers)
    for task in self.tasks:
      task.reader.join(_DRAIN_S)


def _names(tasks: Sequence[_Task]) -> str:
  return ", ".join(t.name for t in tasks)


@contextlib.contextmanager
def _forward_signals(run: _Run, enabled: bool) -> Iterator[None]:
  """Records SIGINT/SIGTERM in `run` (main thread only); restores handlers."""
  if not enabled or threading.current_thread() is not threading.main_thread():
    yield
    return
  sigs = (signal.SIGINT, signal.SIGTERM)
  previous = {s: signal.getsignal(s) for s in sigs}
  for s in sigs:
    signal.signal(s, lambda signum, frame: run.signals.append(signum))
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def launch(command: Sequence[str], *, num_workers: int, num_ps: int = 0,
           chief: bool = False, host: str = "127.0.0.1",
           base_port: int | None = None, timeout_s: float | None = None,
           grace_s: float = 10.0, env: Mapping[str, str] | None = None,
           output: TextIO | None = None, handle_signals: bool = True
           ) -> LaunchResult:
  """Runs `command` once per task of a local cluster and waits for it.

  See the module docstring for the TF_CONFIG contract, when the launch counts
  as a success, and how tasks are stopped.

  Args:
    command: the program and its arguments, e.g.
      `[sys.executable, "-m", "tfmgpu.train", "--strategy=..."]`.
    num_workers: number of "worker" tasks, at least 1.
    num_ps: number of "ps" tasks. Defaults to `0`.
    chief: whether to add a "chief" task (the parameter-server coordinator).
      Defaults to `False`.
    host: the address tasks use to reach each other. Defaults to
      `"127.0.0.1"`.
    base_port: first of consecutive ports for the tasks. Defaults to `None`:
      pick free ports.
    timeout_s: stop everything after this many seconds (exit code 124).
      Defaults to `None`: no limit.
    grace_s: seconds between SIGTERM and SIGKILL when stopping tasks.
      Defaults to `10.0`.
    env: the environment every task starts from, before TF_CONFIG and
      TFMGPU_TASK are added. Defaults to `os.environ`.
    output: where task output and launcher messages go. Defaults to
      `sys.stdout`, read at call time.
    handle_signals: whether to catch SIGINT/SIGTERM while running (only
      possible in the main thread) and stop the tasks. Defaults to `True`.

  Returns:
    A `LaunchResult`; its `exit_code` is 0 only if the run succeeded.

  Raises:
    ValueError: an argument is invalid or the program is not found.
    PortInUseError: a port from `base_port` on cannot be bound.
  """
  config = ClusterConfig(num_workers, num_ps, chief, host, base_port)
  if isinstance(command, str) or not command or not all(
      isinstance(c, str) for c in command):
    raise ValueError(f"command={command!r} is invalid: give the program and "
                     "its arguments as a non-empty list of strings, e.g. "
                     "[sys.executable, '-m', 'tfmgpu.train', ...].")
  env = dict(os.environ if env is None else env)
  if shutil.which(command[0], path=env.get("PATH")) is None:
    raise ValueError(f"command[0]={command[0]!r} is not an executable file "
                     "or on PATH. Give a program path, e.g. sys.executable.")
  if timeout_s is not None and not timeout_s > 0:
    raise ValueError(f"timeout_s={timeout_s!r} is invalid: use a number of "
                     "seconds > 0, or None for no limit.")
  if not grace_s >= 0:
    raise ValueError(f"grace_s={grace_s!r} is invalid: use a number of "
                     "seconds >= 0 (0 sends SIGKILL right after SIGTERM).")
  if not hasattr(os, "killpg"):
    raise NotImplementedError("launch needs process groups (Linux, macOS); "
                              f"this platform is {sys.platform!r}.")
  cluster = config.make_cluster()
  run = _Run(output if output is not None else sys.stdout, float(grace_s))
  started = time.monotonic()
  with _forward_signals(run, handle_signals):
    try:
      run.start(list(command), config, cluster, env)
      outcome, exit_code = run.supervise(config, timeout_s, started)
    finally:
      run.cleanup()
  duration = time.monotonic() - started
  codes = {t.name: t.proc.returncode for t in run.tasks}
  run.say(f"Finished in {duration:.1f} s with exit code {exit_code} "
          f"({outcome.value}): " + ", ".join(
              f"{t.name} {_describe_exit(t.proc.returncode)}"
              f"{' (stopped)' if t.stopped else ''}" for t in run.tasks))
  return LaunchResult(
      exit_code=exit_code, outcome=outcome, task_exit_codes=codes,
      first_failure=run.first_failure,
      stopped=tuple(t.name for t in run.tasks if t.stopped),
      pids={t.name: t.proc.pid for t in run.tasks}, cluster=cluster,
      duration_s=duration)
