"""Run `python -m tfmgpu.train` on a local cluster, for the cluster tests.

Every cluster runs on 127.0.0.1 through `tfmgpu.launcher` (which stops every
task it started), with a timeout on every wait. `ClusterRun` runs a launch in
a background thread so that a test can watch the output and signal a task.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading
import time

import psutil

from tfmgpu import launcher
from tfmgpu.config import TrainConfig

# Scripts run by path import this checkout's tfmgpu, not an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
    p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
ENV.pop("TF_CONFIG", None)

# One run's shape, shared by the multi-worker, parity and preemption tests so
# that the uninterrupted 2-worker run is computed once.
# The digits dithered (see `dithered_digits`): one process and two workers
# sum per-example gradients in different orders (3e-7 apart after a step),
# and on the digits' tied max-pools that drifted them 1e-2 apart.
DITHERED_DIGITS = os.path.join(os.path.dirname(__file__),
                               "dithered_digits.py") + ":load"
MWMS_ARGS = (f"--dataset={DITHERED_DIGITS}", "--epochs=3",
             "--steps_per_epoch=30", "--steps_per_execution=1",
             "--global_batch_size=64", "--seed=0", "--verbose=0")


def reference_config(model_dir, **changes) -> TrainConfig:
  """One process, mirrored over 2 replicas: the same run as MWMS_ARGS."""
  config = TrainConfig(strategy="mirrored", num_replicas=2, epochs=3,
                       dataset=DITHERED_DIGITS,
                       steps_per_epoch=30, steps_per_execution=1,
                       global_batch_size=64, seed=0, verbose=0,
                       model_dir=str(model_dir))
  return config.replace(**changes)


def train_command(*args: str) -> list[str]:
  return [sys.executable, "-m", "tfmgpu.train", *args]


class _Output(io.TextIOBase):
  """Collects the launcher's output lines (thread-safe enough for appends)."""

  def __init__(self):
    super().__init__()
    self.parts: list[str] = []

  def write(self, text: str) -> int:
    self.parts.append(text)
    return len(text)

  @property
  def text(self) -> str:
    return "".join(self.parts)


class ClusterRun:
  """A `launcher.launch` of `command` running in a background thread."""

  def __init__(self, command: list[str], *, tmpdir: str | None = None,
               timeout_s: float = 150, grace_s: float = 5, **cluster):
    self.output = _Output()
    self.result: launcher.LaunchResult | None = None
    env = dict(ENV)
    if tmpdir:
      os.makedirs(tmpdir, exist_ok=True)
      env["TMPDIR"] = tmpdir
    self._error: BaseException | None = None

    def target():
      try:
        self.result = launcher.launch(
            command, timeout_s=timeout_s, grace_s=grace_s, env=env,
            output=self.output, handle_signals=False, **cluster)
      except BaseException as e:  # pylint: disable=broad-except
        self._error = e

    self._thread = threading.Thread(target=target, daemon=True)
    self._thread.start()

  @property
  def text(self) -> str:
    return self.output.text

  def wait_for(self, pattern: str, timeout_s: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      match = re.search(pattern, self.text)
      if match:
        return match
      if not self._thread.is_alive():
        break
      time.sleep(0.02)
    raise AssertionError(f"{pattern!r} not seen in:\n{self.text[-4000:]}")

  def signal_task(self, name: str, sig: int) -> int:
    """Sends `sig` to the task `name` (e.g. "worker:1"); returns its pid."""
    for proc in psutil.Process().children(recursive=True):
      try:
        # The task itself leads its process group (children inherit its env).
        if (proc.environ().get("TFMGPU_TASK") == name and
            os.getpgid(proc.pid) == proc.pid):
          os.kill(proc.pid, sig)
          return proc.pid
      except (psutil.Error, ProcessLookupError):
        continue
    raise AssertionError(f"task {name} not found")

  def join(self, timeout_s: float = 180) -> launcher.LaunchResult:
    self._thread.join(timeout_s)
    assert not self._thread.is_alive(), "launcher did not return in time"
    if self._error:
      raise self._error
    return self.result


def run_cluster(args, **kwargs) -> tuple[launcher.LaunchResult, str]:
  run = ClusterRun(train_command(*args), **kwargs)
  result = run.join()
  return result, run.text


def task_lines(text: str, task: str) -> str:
  """The output lines of one task, without the `[task] ` prefix."""
  prefix = f"[{task}] "
  return "\n".join(l[len(prefix):] for l in text.splitlines()
                   if l.startswith(prefix))


def summary_value(text: str, task: str, key: str) -> str:
  match = re.search(rf"^{re.escape(key)}\s+(.+)$", task_lines(text, task),
                    re.MULTILINE)
  assert match, f"no {key!r} in {task}'s output:\n{text[-3000:]}"
  return match.group(1).strip()
