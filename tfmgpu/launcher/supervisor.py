"""Start every task of a local cluster and supervise them until the run ends.

`launch` runs one command once per task (see `tfmgpu.launcher` for the
TF_CONFIG contract) and waits:

* The run succeeds once every task that does the work has exited 0 (the
  chief of a parameter-server cluster, else the chief and workers); the
  servers left running are stopped with SIGTERM.
* The first task to exit non-zero or die by a signal is named, the others get
  SIGTERM, then SIGKILL after `grace_s`. The exit code is that task's code,
  or 128 + the signal number.
* Parameter-server training (ps tasks and a coordinator, the chief) survives
  a lost worker: its exit is logged and the run goes on, as the coordinator
  reschedules the worker's steps on the others. Losing the last worker, a
  ps task or the coordinator stops the run.
* After `timeout_s` everything is stopped the same way; exit code 124.
* SIGINT or SIGTERM to the launcher stops the tasks the same way; exit code
  130 or 143, or 42 when every task that does the work exited with 42
  (stopped after saving a checkpoint: rerun to resume). A second signal
  skips the rest of the grace period.
* A task that does the work exiting with 42 on its own (a signal sent to it,
  which every such task saved a checkpoint for) is waited for, not failed:
  when the others exit with 42 within `grace_s`, the run ends with 42.
* Stopping a parameter-server cluster goes in order: the coordinator first,
  given `grace_s` to save a checkpoint while the servers still hold its
  variables; then the workers; the parameter servers last. Other clusters
  are stopped all at once.
* Whatever happens (success, failure, exception), every process group still
  alive at the end is stopped, so no task or child of a task outlives the
  launcher -- unless the launcher itself is killed with SIGKILL.

The launcher's own messages start with `[launcher] `. Before it stops the
tasks it writes why (`worker:1 exited with code 1`, `its timeout_s=120
elapsed`) to a note each task can read (`tfmgpu.stop_notes`), so that a
task's SIGTERM says what it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TextIO

from tfmgpu import stop_notes
from tfmgpu.launcher import cluster_spec
from tfmgpu.launcher import processes
from tfmgpu.launcher.processes import Task

EXIT_TIMEOUT = 124  # As coreutils' `timeout`.

_POLL_S = 0.05
_KILL_WAIT_S = 5.0  # After SIGKILL, how long to wait for the processes to go.
_DRAIN_S = 1.0  # How long to wait for a finished task's last output lines.
# `tfmgpu.training.checkpoints.EXIT_PREEMPTED` (not imported: it loads TF).
_EXIT_PREEMPTED = 42


class Outcome(str, enum.Enum):
  """How a launch ended."""
  SUCCEEDED = "succeeded"
  TASK_FAILED = "task_failed"
  TIMED_OUT = "timed_out"
  INTERRUPTED = "interrupted"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
  """What happened to a launched cluster.

  Attributes:
    exit_code: 0 on success; else the first failed task's exit code (128 +
      signal if it was killed), 124 on timeout, 128 + signal if the launcher
      was interrupted; 42 when every task that trains exited with 42.
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
    lost: workers of a parameter-server cluster that exited while the run
      went on without them.
  """
  exit_code: int
  outcome: Outcome
  task_exit_codes: dict[str, int | None]
  first_failure: str | None
  stopped: tuple[str, ...]
  pids: dict[str, int]
  cluster: dict[str, list[str]]
  duration_s: float
  lost: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    return self.exit_code == 0


class _Run:
  """The state of one `launch`: tasks, output and received signals."""

  def __init__(self, output: TextIO, grace_s: float):
    self.output = output
    self.grace_s = grace_s
    self.tasks: list[Task] = []
    self.signals: list[int] = []
    self.first_failure: str | None = None
    self.coordinated = False  # Parameter servers with a coordinator.
    self.lost: list[str] = []  # Workers lost and tolerated.
    self.note = stop_notes.new_path()  # Why tasks were stopped, for them.
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

  def start(self, command: list[str], config: cluster_spec.ClusterConfig,
            cluster: dict[str, list[str]], env: Mapping[str, str]) -> None:
    self.say(f"Starting {config.num_tasks} task(s) on cluster "
             f"{json.dumps(cluster)}.")
    self.coordinated = bool(config.num_ps and config.chief)
    for task_type, index in config.tasks:
      name = f"{task_type}:{index}"
      task_env = dict(env)
      task_env["TF_CONFIG"] = cluster_spec.tf_config_for(cluster, task_type,
                                                         index)
      task_env["TFMGPU_TASK"] = name
      task_env[stop_notes.NOTE_ENV] = self.note
      task_env.setdefault("PYTHONUNBUFFERED", "1")
      self.tasks.append(
          Task.start(name, task_type, command, task_env, self.write))

  def running(self) -> list[Task]:
    return [t for t in self.tasks if t.running()]

  def supervise(self, config: cluster_spec.ClusterConfig,
                timeout_s: float | None, started: float
                ) -> tuple[Outcome, int]:
    """Waits until success, a failure, the timeout or a signal; stops tasks."""
    primaries = [t for t in self.tasks if t.type in config.primary_types]
    while True:
      if self.signals:
        return self._interrupted(primaries)
      preempted = self._preempted(primaries)
      if preempted is not None:
        return preempted
      failed = self._failure()
      if failed is not None:
        return Outcome.TASK_FAILED, failed
      if all(t.proc.returncode == 0 for t in primaries):
        servers = self.running()
        if servers:
          kinds = sorted({t.type for t in primaries},
                         key=cluster_spec.TASK_TYPES.index)
          self.say(f"All {' and '.join(kinds)} tasks succeeded; stopping "
                   "the server tasks, which never exit on their own: "
                   f"{processes.names(servers)}.")
          self.stop(servers)
        return Outcome.SUCCEEDED, 0
      if timeout_s is not None and time.monotonic() - started >= timeout_s:
        running = self.running()
        self.say(f"Timed out: timeout_s={timeout_s:g} elapsed with "
                 f"{len(running)} task(s) still running: "
                 f"{processes.names(running)}. Stopping them.")
        stop_notes.write(self.note, f"its timeout_s={timeout_s:g} elapsed")
        self.stop(running)
        return Outcome.TIMED_OUT, EXIT_TIMEOUT
      time.sleep(_POLL_S)

  def _interrupted(self, primaries: Sequence[Task]) -> tuple[Outcome, int]:
    """Stops every task after a signal; 42 if the work all saved and left."""
    sig = self.signals[0]
    self.say(f"Received {signal.Signals(sig).name}; stopping all tasks.")
    stop_notes.write(self.note, f"it received {signal.Signals(sig).name}")
    self.stop(self.running())
    if primaries and all(t.proc.returncode == _EXIT_PREEMPTED
                         for t in primaries):
      self.say(f"Every task that trains exited with {_EXIT_PREEMPTED} "
               "(checkpoint saved): run the same command again to resume.")
      return Outcome.INTERRUPTED, _EXIT_PREEMPTED
    return Outcome.INTERRUPTED, 128 + sig

  def _preempted(self, primaries: Sequence[Task]
                 ) -> tuple[Outcome, int] | None:
    """42 when a task that trains exited with 42 and so, within `grace_s`,
    did every other one: a preemption signal sent to a task (not to the
    launcher) that they all saved a checkpoint for. Stopping them as failed
    killed a chief that was leaving after its save. `None` otherwise (a
    task still running then, or another code: `_failure` names it)."""
    first = next((t for t in primaries
                  if t.proc.poll() == _EXIT_PREEMPTED), None)
    if first is None:
      return None
    deadline = time.monotonic() + self.grace_s
    while (any(t.proc.poll() is None for t in primaries)
           and time.monotonic() < deadline and not self.signals
           and not any(t.proc.poll() not in (None, 0, _EXIT_PREEMPTED)
                       for t in self.tasks)):  # A crash: _failure names it.
      time.sleep(_POLL_S)
    if self.signals:  # The launcher's own (a scheduler stopping the job).
      return self._interrupted(primaries)
    if not all(t.proc.returncode == _EXIT_PREEMPTED for t in primaries):
      return None
    first.reader.join(_DRAIN_S)
    self.say(f"{first.name} exited with {_EXIT_PREEMPTED} (stopped by a "
             "signal after saving a checkpoint) and every task that trains "
             "did the same: run the same command again to resume.")
    stop_notes.write(self.note, f"{first.name} was preempted")
    self.stop(self.running())  # Servers, which never exit on their own.
    return Outcome.INTERRUPTED, _EXIT_PREEMPTED

  def _failure(self) -> int | None:
    """The exit code if a task failed the run (after stopping the others).

    A lost worker of a parameter-server cluster is logged and tolerated
    while another worker runs.
    """
    # A task that saved and left (42) is named only when no other failed.
    for task in sorted(self.tasks,
                       key=lambda t: t.proc.poll() == _EXIT_PREEMPTED):
      code = task.proc.poll()
      if code is None or code == 0 or task.name in self.lost:
        continue
      task.reader.join(_DRAIN_S)
      what = f"Task {task.name} {processes.describe_exit(code)}."
      workers = [t for t in self.running() if t.type == "worker"]
      if self.coordinated and task.type == "worker" and workers:
        self.lost.append(task.name)
        self.say(f"{what} Parameter-server training goes on without it: the "
                 "coordinator reschedules its steps on the other workers "
                 f"({processes.names(workers)}).")
        continue
      self.first_failure = task.name
      others = self.running()
      if self.coordinated and task.type == "worker":
        what += " No worker is left to run the coordinator's steps."
      self.say(what + (f" Stopping the other tasks: {processes.names(others)}."
                       if others else ""))
      stop_notes.write(self.note,
                       f"{task.name} {processes.describe_exit(code)}")
      self.stop(others)
      return code if code > 0 else 128 - code
    return None

  def stop(self, tasks: Sequence[Task]) -> None:
    """Stops the tasks: at once, or in order under parameter servers.

    A coordinated parameter-server cluster is stopped coordinator first (it
    saves a checkpoint while the servers still hold its variables), then the
    workers, then the parameter servers, each given `grace_s`.
    """
    if not self.coordinated:
      self._stop_now(tasks)
      return
    for task_type in cluster_spec.TASK_TYPES:  # chief, worker, ps.
      self._stop_now([t for t in tasks if t.type == task_type])

  def _stop_now(self, tasks: Sequence[Task]) -> None:
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
    self.say(f"{why} and {processes.names(left)} still running after SIGTERM; "
             "sending SIGKILL.")
    for task in left:
      task.signal(signal.SIGKILL)
    deadline = time.monotonic() + _KILL_WAIT_S
    while any(t.alive() for t in left) and time.monotonic() < deadline:
      time.sleep(_POLL_S)
    left = [t for t in left if t.alive()]
    if left:
      self.say(f"Could not stop process groups {[t.proc.pid for t in left]} "
               f"({processes.names(left)}); check them with `ps -g`.")

  def cleanup(self) -> None:
    """Stops whatever still runs (any path), then drains the output."""
    leftovers = [t for t in self.tasks if t.alive()]
    if leftovers:
      self.say("Stopping processes still running in: "
               f"{processes.names(leftovers)}.")
      self.stop(leftovers)
    for task in self.tasks:
      task.reader.join(_DRAIN_S)
    stop_notes.remove(self.note)

  def result(self, outcome: Outcome, exit_code: int,
             cluster: dict[str, list[str]], started: float) -> LaunchResult:
    """Says how every task ended; returns the `LaunchResult`."""
    duration = time.monotonic() - started
    self.say(f"Finished in {duration:.1f} s with exit code {exit_code} "
             f"({outcome.value}): " + ", ".join(
                 f"{t.name} {processes.describe_exit(t.proc.returncode)}"
                 f"{' (stopped)' if t.stopped else ''}" for t in self.tasks))
    return LaunchResult(
        exit_code=exit_code, outcome=outcome,
        task_exit_codes={t.name: t.proc.returncode for t in self.tasks},
        first_failure=self.first_failure,
        stopped=tuple(t.name for t in self.tasks if t.stopped),
        pids={t.name: t.proc.pid for t in self.tasks}, cluster=cluster,
        duration_s=duration, lost=tuple(self.lost))


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

  See `tfmgpu.launcher` for the TF_CONFIG contract and this module's
  docstring for when the launch counts as a success and how tasks are
  stopped.

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
  config = cluster_spec.ClusterConfig(num_workers, num_ps, chief, host,
                                      base_port)
  env = dict(os.environ if env is None else env)
  _check_launch(command, env, timeout_s, grace_s)
  cluster = config.make_cluster()
  run = _Run(output if output is not None else sys.stdout, float(grace_s))
  started = time.monotonic()
  with _forward_signals(run, handle_signals):
    try:
      run.start(list(command), config, cluster, env)
      outcome, exit_code = run.supervise(config, timeout_s, started)
    finally:
      run.cleanup()
  return run.result(outcome, exit_code, cluster, started)


def _check_launch(command: Sequence[str], env: Mapping[str, str],
                  timeout_s: float | None, grace_s: float) -> None:
  """Validates `launch`'s arguments other than the cluster's shape.

  Raises:
    ValueError: an argument is invalid or the program is not found.
    NotImplementedError: the platform has no process groups.
  """
  if isinstance(command, str) or not command or not all(
      isinstance(c, str) for c in command):
    raise ValueError(f"command={command!r} is invalid: give the program and "
                     "its arguments as a non-empty list of strings, e.g. "
                     "[sys.executable, '-m', 'tfmgpu.train', ...].")
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
