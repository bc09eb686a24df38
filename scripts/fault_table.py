r"""Injects faults and bad inputs into real runs; prints what held (issue 16).

Every case runs `python -m tfmgpu.train` / `tfmgpu.predict` (and the launcher
for the cluster cases) as subprocesses with tiny settings (digits, an MLP, 2
epochs of 5 steps), injects one fault or bad input, and checks the outcome:

* a fault "survived with nothing lost" when the runs that follow end with the
  weights of an uninterrupted run, bit for bit (the summary's weights
  digest), or, where no training follows, nothing written was damaged; plus
  the fault's own check (exit 42 kept, the stale lock reported, ...);
* a bad input got "a clear error" when the command exits 1 with exactly one
  `error:` paragraph naming the path or value, and no traceback.

Faults are injected from outside: signals after a given global step (a
small wrapper, `_HARNESS`, adds a Keras callback to the run and then runs
`tfmgpu.train` as `python -m` would), SIGKILL at a system call (`strace
-e inject=...`) and a full disk (a small tmpfs in a private mount namespace,
`unshare -rm`). Cases whose tool is missing are listed as skipped.

  python scripts/fault_table.py            # everything (~13 min on 2 cores)
  python scripts/fault_table.py --quick    # without the cluster cases

Prints a Markdown table and the line
"N injected, N survived with nothing lost; N bad inputs, N clear errors".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
TIMEOUT_S = 600
BASE = ("--strategy=one_device", "--dataset=digits", "--model=mlp",
        "--epochs=2", "--steps_per_epoch=5", "--steps_per_execution=1",
        "--global_batch_size=64", "--verbose=0")

# Runs `tfmgpu.train` as `python -m` does, with one fault: after global step
# STEP, "term" / "kill" sends this process SIGTERM / SIGKILL, "pause" waits
# for the file $FAULT_GO (after creating $FAULT_PAUSED); "term_twice" also
# sends a second SIGTERM once the preemption checkpoint is saved.
_HARNESS = r"""
import os, runpy, signal, sys, time
import keras
action, step = sys.argv[1], int(sys.argv[2])
sys.argv = ["tfmgpu.train", *sys.argv[3:]]
from tfmgpu import runs
from tfmgpu.training import preemption

class Fault(keras.callbacks.Callback):
  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch
  def on_train_batch_end(self, batch, logs=None):
    if self.epoch * self.params["steps"] + batch + 1 != step:
      return
    if action in ("term", "term_twice"):
      os.kill(os.getpid(), signal.SIGTERM)
    elif action == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    elif action == "pause":
      open(os.environ["FAULT_PAUSED"], "w").close()
      deadline = time.monotonic() + 300
      while not os.path.exists(os.environ["FAULT_GO"]):
        assert time.monotonic() < deadline, "never told to go on"
        time.sleep(0.05)

make_trainer = runs.make_trainer
runs.make_trainer = lambda *a, callbacks=(), **k: make_trainer(
    *a, callbacks=[*callbacks, Fault()], **k)
if action == "term_twice":
  exit_watcher = preemption.PreemptionWatcher.__exit__
  def exit_and_resend(self, *exc):
    exit_watcher(self, *exc)
    os.kill(os.getpid(), signal.SIGTERM)  # A scheduler resending it.
  preemption.PreemptionWatcher.__exit__ = exit_and_resend
runpy.run_module("tfmgpu.train", run_name="__main__", alter_sys=True)
"""

# Runs module argv[2] as `python -m` does, SIGKILLing it at the final rename
# onto argv[1] (`os.replace`, which `files.write_atomically` and the model
# save use): strace 6.1's -P matches only a rename's source, a random name.
_KILL_AT_RENAME = r"""
import os, runpy, signal, sys
target, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
replace = os.replace
def kill_at(src, dst, *args, **kwargs):
  if os.path.abspath(dst) == target:
    os.kill(os.getpid(), signal.SIGKILL)
  return replace(src, dst, *args, **kwargs)
os.replace = kill_at
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@dataclasses.dataclass
class Run:
  """One finished command."""
  code: int
  out: str
  err: str

  @property
  def digest(self) -> str | None:
    match = re.search(r"^weights sha256\s+(\S+)", self.out, re.M)
    return match.group(1) if match else None

  def tail(self) -> str:
    return (self.err.strip().splitlines() or [""])[-1][:160]


@dataclasses.dataclass
class Row:
  """One line of the table."""
  kind: str  # "fault" or "bad input".
  case: str
  outcome: str
  held: bool | None  # None: skipped.


def run(command: list[str], *, env: dict | None = None,
        timeout: float = TIMEOUT_S) -> Run:
  proc = subprocess.run(command, capture_output=True, text=True,
                        timeout=timeout, env=env or ENV, check=False)
  return Run(proc.returncode, proc.stdout, proc.stderr)


def train(model_dir: str, *args: str, harness: str | None = None,
          prefix: tuple[str, ...] = ()) -> Run:
  """`python -m tfmgpu.train BASE --model_dir=model_dir args`."""
  flags = [*BASE, f"--model_dir={model_dir}", *args]
  if harness:
    action, step = harness.split(":")
    return run([*prefix, PY, "-c", _HARNESS, action, step, *flags])
  return run([*prefix, PY, "-m", "tfmgpu.train", *flags])


def predict(*args: str, prefix: tuple[str, ...] = ()) -> Run:
  return run([*prefix, PY, "-m", "tfmgpu.predict", "--dataset=digits",
              "--strategy=default", *args])


def clear_error(result: Run, *needles: str) -> tuple[bool, str]:
  """Exit 1, one `error:` paragraph with every needle, no traceback."""
  errors = [l for l in result.err.splitlines() if l.startswith("error: ")]
  text = result.err[result.err.find("error: "):] if errors else ""
  ok = (result.code == 1 and len(errors) == 1 and "Traceback" not in
        result.err and all(n in text for n in needles))
  first = errors[0] if errors else result.tail()
  return ok, f"exit {result.code}: `{first[:200]}`"


def strace_kill_at(syscall: str, path: str | None = None) -> tuple[str, ...]:
  """A command prefix: SIGKILL the run at `syscall` (on `path`)."""
  prefix = ("strace", "-f", "-qq", "-o", "/dev/null", "-e",
            f"trace={syscall}", "-e", f"inject={syscall}:signal=SIGKILL")
  # (Not --seccomp-bpf: faster, but strace 6.1 then injects nothing.)
  return prefix + (("-P", path) if path else ())


def in_small_disk(size_kib: int, mount: str, then_copy: str | None,
                  command: list[str]) -> Run:
  """Runs `command` with a tmpfs of `size_kib` at `mount` (private mount
  namespace); copies `mount` to `then_copy` afterwards."""
  os.makedirs(mount, exist_ok=True)
  script = (f"mount -t tmpfs -o size={size_kib}k none {mount} && "
            f"{' '.join(map(_quote, command))}; code=$?; "
            + (f"cp -a {mount}/. {then_copy}/; " if then_copy else "")
            + "exit $code")
  return run(["unshare", "-rm", "sh", "-c", script])


def _quote(arg: str) -> str:
  return "'" + arg.replace("'", "'\"'\"'") + "'"


def _has(tool: str, probe: list[str]) -> bool:
  if not shutil.which(tool):
    return False
  return subprocess.run(probe, capture_output=True, timeout=60,
                        check=False).returncode == 0


class Table:
  """The cases, sharing a work directory and the uninterrupted reference."""

  def __init__(self, work: str, quick: bool):
    self.work, self.quick = work, quick
    self.rows: list[Row] = []
    self.strace = _has("strace", ["strace", "-qq", "-o", "/dev/null", "true"])
    self.unshare = _has("unshare", ["unshare", "-rm", "true"])
    reference = train(self.dir("reference"))
    assert reference.code == 0 and reference.digest, reference.err[-3000:]
    self.digest = reference.digest
    self.model = os.path.join(self.dir("reference"), "model.keras")

  def dir(self, name: str) -> str:
    return os.path.join(self.work, name)

  def add(self, kind: str, case: str, held: bool | None, outcome: str):
    outcome = outcome.replace(self.work, "$W")  # The work directory.
    self.rows.append(Row(kind, case, outcome, held))
    mark = {True: "held", False: "NOT HELD", None: "skipped"}[held]
    print(f"[{mark}] {kind}: {case}: {outcome}", file=sys.stderr, flush=True)

  def exact(self, result: Run) -> bool:
    return result.code == 0 and result.digest == self.digest


FAULTS: list[Callable[[Table], None]] = []
BAD_INPUTS: list[Callable[[Table], None]] = []


def fault(fn):
  FAULTS.append(fn)
  return fn


def bad_input(fn):
  BAD_INPUTS.append(fn)
  return fn


# --------------------------------------------------------------- faults


@fault
def sigterm_mid_epoch(t: Table) -> None:
  d = t.dir("sigterm")
  first = train(d, harness="term:7")
  again = train(d)
  t.add("fault", "SIGTERM 2 steps into epoch 2", first.code == 42 and
        t.exact(again), f"exit {first.code}; rerun exit {again.code}, "
        f"weights {'equal' if t.exact(again) else 'DIFFER'}")


@fault
def sigterm_resent_after_the_save(t: Table) -> None:
  d = t.dir("sigterm_twice")
  first = train(d, harness="term_twice:7")
  again = train(d)
  t.add("fault", "SIGTERM, then SIGTERM again after the save",
        first.code == 42 and t.exact(again),
        f"exit {first.code} (not 143); rerun weights "
        f"{'equal' if t.exact(again) else 'DIFFER'}")


@fault
def kill_while_resaving(t: Table) -> None:
  if not t.strace:
    return t.add("fault", "SIGKILL at the open of ckpt-3.index", None,
                 "strace unavailable")
  d = t.dir("torn")
  first = train(d, harness="term:7")  # ckpt-2 saved mid-epoch 2.
  index = os.path.join(d, "checkpoints", "ckpt-3.index")
  killed = train(d, prefix=strace_kill_at("openat", index))
  again = train(d)
  t.add("fault", "SIGTERM mid-epoch 2, then SIGKILL at the open of "
        "ckpt-3.index while the resumed run saves (#16 item 1)",
        first.code == 42 and killed.code != 0 and t.exact(again),
        f"exits {first.code}, {killed.code}; rerun resumed from "
        f"{_resumed_from(again)}, weights "
        f"{'equal' if t.exact(again) else 'DIFFER'}")


def _resumed_from(result: Run) -> str:
  match = re.search(r"Resumed from (\S+): epoch (\d+), step (\d+)", result.err)
  whole = re.search(r"Resumed from (\S+): (after \d+ whole epochs?)",
                    result.err)
  if whole:  # At an epoch boundary.
    return f"{os.path.basename(whole.group(1))} ({whole.group(2)})"
  if not match:
    return "scratch"
  return (f"{os.path.basename(match.group(1))} (epoch {match.group(2)}, step "
          f"{match.group(3)} of it)")


@fault
def kill_during_the_first_save(t: Table) -> None:
  if not t.strace:
    return t.add("fault", "SIGKILL while ckpt-1 is written", None,
                 "strace unavailable")
  d = t.dir("first_save")
  index = os.path.join(d, "checkpoints", "ckpt-1.index")
  killed = train(d, prefix=strace_kill_at("openat", index))
  again = train(d)
  t.add("fault", "SIGKILL at the open of ckpt-1.index (the first save)",
        killed.code != 0 and t.exact(again),
        f"exit {killed.code}; rerun weights "
        f"{'equal' if t.exact(again) else 'DIFFER'}")


@fault
def kill_mid_epoch_with_step_checkpoints(t: Table) -> None:
  d = t.dir("every_steps")
  killed = train(d, "--checkpoint_every_steps=2", harness="kill:9")
  again = train(d, "--checkpoint_every_steps=2")
  resumed = re.search(r"Resumed from \S+: epoch 2, step (\d) of it, global "
                      r"step (\d+)", again.err)
  t.add("fault", "SIGKILL after step 9 with --checkpoint_every_steps=2",
        killed.code == -9 and bool(resumed) and t.exact(again),
        f"exit {killed.code}; resumed at global step "
        f"{resumed.group(2) if resumed else '?'} (lost "
        f"{9 - int(resumed.group(2)) if resumed else '?'} step); weights "
        f"{'equal' if t.exact(again) else 'DIFFER'}")


@fault
def damaged_newest_checkpoint(t: Table) -> None:
  d = t.dir("damaged")
  done = train(d)
  data = os.path.join(d, "checkpoints", "ckpt-2.data-00000-of-00001")
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) // 2)
  again = train(d)
  skipped = "Skipping checkpoint" in again.err and "ckpt-2" in again.err
  t.add("fault", "newest checkpoint's data file truncated", done.code == 0 and
        skipped and t.exact(again), f"ckpt-2 skipped: {skipped}; resumed "
        f"from ckpt-1, weights {'equal' if t.exact(again) else 'DIFFER'}")


@fault
def state_file_lost(t: Table) -> None:
  for how in ("deleted", "garbage"):
    d = t.dir(f"state_{how}")
    train(d, "--epochs=1")
    state = os.path.join(d, "checkpoints", "checkpoint")
    if how == "deleted":
      os.remove(state)
    else:
      open(state, "wb").write(b"\x00garbage {{")
    again = train(d)
    resumed = "Resumed from" in again.err and "ckpt-1" in again.err
    t.add("fault", f"checkpoint state file {how}", resumed and t.exact(again),
          f"ckpt-1 found by scanning: {resumed}; weights "
          f"{'equal' if t.exact(again) else 'DIFFER'}")


@fault
def two_runs_in_one_dir(t: Table) -> None:
  d = t.dir("two_runs")
  paused, go = t.dir("paused"), t.dir("go")
  env = dict(ENV, FAULT_PAUSED=paused, FAULT_GO=go)
  first = subprocess.Popen([PY, "-c", _HARNESS, "pause", "3", *BASE,
                            f"--model_dir={d}"], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.monotonic() + TIMEOUT_S
  while not os.path.exists(paused) and time.monotonic() < deadline:
    time.sleep(0.1)
  second = train(d, "--seed=1")
  open(go, "w").close()
  out, err = first.communicate(timeout=TIMEOUT_S)
  first_run = Run(first.returncode, out, err)
  refused = f"in use by a live run: PID {first.pid}" in second.err
  t.add("fault", "a second run (--seed=1) while the first trains (#16 item 3)",
        refused and second.code == 1 and t.exact(first_run),
        f"second: {clear_error(second)[1]}; first run's weights "
        f"{'equal' if t.exact(first_run) else 'DIFFER'}")


@fault
def stale_lock(t: Table) -> None:
  d = t.dir("stale")
  killed = train(d, harness="kill:3")
  left = os.path.exists(os.path.join(d, "run.lock"))
  again = train(d)
  taken = "Taking over the stale lock" in again.err
  t.add("fault", "SIGKILL leaves run.lock; the next run takes it over",
        killed.code == -9 and left and taken and t.exact(again),
        f"lock left: {left}; reported and taken over: {taken}; weights "
        f"{'equal' if t.exact(again) else 'DIFFER'}")


def _sizes(t: Table) -> tuple[int, int]:
  """KiB of one checkpoint and of model.keras in the reference run."""
  ckpt = sum(os.path.getsize(p) for p in [
      os.path.join(t.dir("reference"), "checkpoints", f)
      for f in os.listdir(os.path.join(t.dir("reference"), "checkpoints"))]
             if os.path.basename(p).startswith("ckpt-2."))
  return ckpt // 1024, os.path.getsize(t.model) // 1024


@fault
def disk_full_while_saving(t: Table) -> None:
  if not t.unshare:
    return t.add("fault", "disk full while saving", None, "unshare unavailable")
  ckpt, model = _sizes(t)
  for what, size in (("checkpoint ckpt-2", ckpt * 3 // 2 + 64),
                     ("model.keras", ckpt * 2 + model // 2 + 64)):
    d, mount = t.dir(f"full_{what[:5]}"), t.dir(f"mnt_{what[:5]}")
    os.makedirs(d, exist_ok=True)
    full = in_small_disk(size, mount, d, [PY, "-m", "tfmgpu.train", *BASE,
                                          f"--model_dir={mount}"])
    ok, outcome = clear_error(full, "disk full while writing", mount)
    again = train(d)  # The same directory, with room again.
    t.add("fault", f"disk full while saving {what} ({size} KiB disk)",
          ok and t.exact(again), f"{outcome}; rerun with room: weights "
          f"{'equal' if t.exact(again) else 'DIFFER'}")


@fault
def predict_killed_before_the_rename(t: Table) -> None:
  if not t.strace:
    return t.add("fault", "predict killed while writing", None,
                 "strace unavailable")
  out_dir = t.dir("predict_kill")
  os.makedirs(out_dir)
  out = os.path.join(out_dir, "p.npy")
  killed = predict(f"--model_path={t.model}", f"--output={out}",
                   prefix=strace_kill_at("fsync"))
  left = os.listdir(out_dir)
  again = predict(f"--model_path={t.model}", f"--output={out}")
  mode = stat.S_IMODE(os.stat(out).st_mode) if os.path.exists(out) else 0
  umask = os.umask(0)
  os.umask(umask)
  t.add("fault", "predict SIGKILLed before its output is renamed",
        killed.code != 0 and not left and again.code == 0 and
        mode == 0o666 & ~umask, f"files left: {left or 'none'}; rerun "
        f"writes mode {oct(mode)} (umask {oct(umask)})")


@fault
def predict_disk_full(t: Table) -> None:
  if not t.unshare:
    return t.add("fault", "disk full while predict writes", None,
                 "unshare unavailable")
  mount, copy = t.dir("mnt_predict"), t.dir("predict_full")
  os.makedirs(copy)
  out = os.path.join(mount, "p.npy")
  full = in_small_disk(16, mount, copy, [
      PY, "-m", "tfmgpu.predict", "--dataset=digits", "--strategy=default",
      f"--model_path={t.model}", f"--output={out}"])
  ok, outcome = clear_error(full, "disk full while writing", out)
  left = os.listdir(copy)
  t.add("fault", "disk full while predict writes its output (16 KiB disk)",
        ok and not left, f"{outcome}; files left: {left or 'none'}")


@fault
def parameter_server_worker_lost(t: Table) -> None:
  if t.quick:
    return t.add("fault", "parameter-server worker SIGKILLed", None, "--quick")
  d = t.dir("ps")
  command = [PY, "-m", "tfmgpu.launch", "--num_workers=2", "--num_ps=1",
             "--coordinator", "--timeout_s=500", "--", PY, "-m",
             "tfmgpu.train", "--strategy=parameter_server", "--model=mlp",
             "--epochs=3", "--steps_per_epoch=40", "--steps_per_execution=1",
             "--verbose=0", f"--model_dir={d}"]
  proc = subprocess.Popen(command, env=ENV, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  lines = _watch_until(proc, r"\[chief:0\] .*epoch 1/3")
  killed = _kill_task("worker:1", signal.SIGKILL)
  out = "".join(lines) + proc.communicate(timeout=TIMEOUT_S)[0]
  final = _load_position(os.path.join(d, "checkpoints"))
  tolerated = "Parameter-server training goes on without it" in out
  t.add("fault", "a parameter-server worker SIGKILLed during epoch 2 "
        "(launcher, #16 item 6)", killed and tolerated and
        proc.returncode == 0 and final == 3,
        f"lost worker tolerated: {tolerated}; exit {proc.returncode}; last "
        f"checkpoint holds epoch {final} of 3")


@fault
def parameter_server_launcher_stopped(t: Table) -> None:
  if t.quick:
    return t.add("fault", "SIGTERM to a parameter-server launcher", None,
                 "--quick")
  d = t.dir("ps_stop")
  command = [PY, "-m", "tfmgpu.launch", "--num_workers=2", "--num_ps=1",
             "--coordinator", "--timeout_s=500", "--", PY, "-m",
             "tfmgpu.train", "--strategy=parameter_server", "--model=mlp",
             "--epochs=3", "--steps_per_epoch=40", "--steps_per_execution=1",
             "--verbose=0", f"--model_dir={d}"]
  proc = subprocess.Popen(command, env=ENV, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  lines = _watch_until(proc, r"\[chief:0\] .*epoch 1/3")
  proc.send_signal(signal.SIGTERM)  # A scheduler stops the whole job.
  out = "".join(lines) + proc.communicate(timeout=TIMEOUT_S)[0]
  saved = re.search(r"\[chief:0\] error: Preempted: .* Saved (\S+) at global "
                    r"step (\d+)", out)
  again = run(command)
  final = _load_position(os.path.join(d, "checkpoints"))
  t.add("fault", "SIGTERM to the launcher of a parameter-server job: the "
        "coordinator is stopped first and saves (#16 item 6)",
        proc.returncode == 42 and bool(saved) and again.code == 0 and
        final == 3, f"exit {proc.returncode}; coordinator saved at global "
        f"step {saved.group(2) if saved else '?'}; rerun exit {again.code}, "
        f"last checkpoint holds epoch {final} of 3")


@fault
def multi_worker_sigterm(t: Table) -> None:
  if t.quick:
    return t.add("fault", "multi-worker SIGTERM", None, "--quick")
  args = ["--strategy=multi_worker_mirrored", "--model=mlp", "--epochs=2",
          "--steps_per_epoch=20", "--steps_per_execution=1", "--verbose=0"]
  launch = [PY, "-m", "tfmgpu.launch", "--num_workers=2", "--timeout_s=500",
            "--", PY, "-m", "tfmgpu.train", *args]
  whole = run(launch + [f"--model_dir={t.dir('mwms_whole')}"])
  proc = subprocess.Popen(launch + [f"--model_dir={t.dir('mwms')}"], env=ENV,
                          text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  _watch_until(proc, r"\[worker:1\] .*epoch 1/2")
  _kill_task("worker:1", signal.SIGTERM)
  proc.communicate(timeout=TIMEOUT_S)
  again = run(launch + [f"--model_dir={t.dir('mwms')}"])
  digests = [re.findall(rf"\[worker:{i}\] weights sha256\s+(\S+)", r.out)
             for r in (whole, again) for i in (0, 1)]
  equal = len({d[0] for d in digests if d}) == 1 and all(digests)
  t.add("fault", "SIGTERM to one worker of 2 (multi_worker_mirrored)",
        proc.returncode == 42 and again.code == 0 and equal,
        f"exit {proc.returncode}; resumed, both workers' weights equal to the "
        f"uninterrupted job's: {equal}")


@fault
def kill_at_the_final_rename(t: Table) -> None:
  """#29 item 5: a whole temporary left by a SIGKILL at the last rename."""
  out_dir = t.dir("rename_kill")
  os.makedirs(out_dir)
  out = os.path.join(out_dir, "p.npy")
  killed = run([PY, "-c", _KILL_AT_RENAME, out, "tfmgpu.predict",
                "--dataset=digits", "--strategy=default",
                f"--model_path={t.model}", f"--output={out}"])
  left = sorted(os.listdir(out_dir))
  again = predict(f"--model_path={t.model}", f"--output={out}")
  after = sorted(os.listdir(out_dir))
  d = t.dir("rename_kill_model")
  first = run([PY, "-c", _KILL_AT_RENAME, os.path.join(d, "model.keras"),
               "tfmgpu.train", *BASE, f"--model_dir={d}"])
  model_left = sorted(f for f in os.listdir(d) if ".tmp-" in f)
  rerun = train(d)
  model_after = sorted(f for f in os.listdir(d) if ".tmp-" in f)
  t.add("fault", "SIGKILL at the final rename of predict's output, then of "
        "model.keras; the next run in the directory (#29 item 5)",
        killed.code == -9 and len(left) == 1 and after == ["p.npy"] and
        again.code == 0 and first.code == -9 and len(model_left) == 1 and
        not model_after and t.exact(rerun),
        f"exits {killed.code}, {first.code}; left: "
        f"{[re.sub(r'[0-9a-f]{32}', 'HEX', f) for f in left + model_left]}; "
        f"after the next runs: "
        f"{[f for f in after if f != 'p.npy'] + model_after or 'none'}; "
        f"weights {'equal' if t.exact(rerun) else 'DIFFER'}")


@fault
def sigterm_after_the_last_step(t: Table) -> None:
  """#29 item 5: SIGTERM after the last step boundary (a parameter-server
  run's short last epoch) logged "then stopping" and exited 0."""
  d = t.dir("sigterm_last")
  first = train(d, harness="term:10")
  announced = "then stopping" in first.err
  again = train(d)
  t.add("fault", "SIGTERM after the last step's boundary check (#29 item 5)",
        first.code == 42 and announced and t.exact(again),
        f"logged 'then stopping': {announced}; exit {first.code}; rerun exit "
        f"{again.code}, weights {'equal' if t.exact(again) else 'DIFFER'}")


@fault
def disk_full_at_lock_time(t: Table) -> None:
  """#29 item 5: a full disk at lock time read as "no flock support"."""
  if not t.unshare:
    return t.add("fault", "disk full at lock time", None, "unshare unavailable")
  mount = t.dir("mnt_lock")
  d = os.path.join(mount, "run")
  fill = (f"head -c 1048576 /dev/zero > {mount}/fill 2>/dev/null; exec "
          + " ".join(map(_quote, [PY, "-m", "tfmgpu.train", *BASE,
                                  f"--model_dir={d}"])))
  full = in_small_disk(512, mount, None, ["sh", "-c", fill])
  ok, outcome = clear_error(full, "disk full while writing",
                            os.path.join(d, "run.lock"))
  t.add("fault", "disk full when the run takes its lock (512 KiB disk, "
        "filled; #29 item 5)", ok, outcome)


@fault
def parameter_server_worker_never_connects(t: Table) -> None:
  """#29 item 2: a worker killed before the coordinator connects."""
  if t.quick:
    return t.add("fault", "parameter-server worker lost before the coordinator "
                 "connects", None, "--quick")
  command = [PY, "-m", "tfmgpu.launch", "--num_workers=2", "--num_ps=1",
             "--coordinator", "--timeout_s=500", "--", PY, "-m",
             "tfmgpu.train", "--strategy=parameter_server", "--model=mlp",
             "--epochs=1", "--steps_per_epoch=5", "--verbose=0",
             "--connect_timeout_s=20", f"--model_dir={t.dir('ps_never')}"]
  started = time.monotonic()
  proc = subprocess.Popen(command, env=ENV, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  lines = _watch_until(proc, r"\[launcher\] Starting")
  killed = False
  while not killed and time.monotonic() < started + 30:
    killed = _kill_task("worker:1", signal.SIGKILL)  # Before TF starts.
    time.sleep(0.05)
  out = "".join(lines) + proc.communicate(timeout=TIMEOUT_S)[0]
  seconds = time.monotonic() - started
  error = re.search(r"\[chief:0\] (error: parameter_server: worker:1 .*did not "
                    r"come up within connect_timeout_s=20 s.*)", out)
  t.add("fault", "a parameter-server worker SIGKILLed before the coordinator "
        "connects, --connect_timeout_s=20 (#29 item 2)", killed and
        proc.returncode == 1 and bool(error) and "Traceback" not in out,
        f"worker:1 killed: {killed}; exit {proc.returncode} after "
        f"{seconds:.0f} s: "
        f"`{error.group(1)[:150] if error else 'no error line'}`")


def _watch_until(proc: subprocess.Popen, pattern: str) -> list[str]:
  lines, deadline = [], time.monotonic() + TIMEOUT_S
  for line in proc.stdout:
    lines.append(line)
    if re.search(pattern, line) or time.monotonic() > deadline:
      break
  return lines


def _kill_task(name: str, sig: int) -> bool:
  """Signals the launched task `name` (its TFMGPU_TASK); True if found."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
      if f"TFMGPU_TASK={name}".encode() in environ and os.getpgid(
          int(pid)) == int(pid):
        os.kill(int(pid), sig)
        return True
    except OSError:
      continue
  return False


def _load_position(directory: str) -> int | None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  latest = tf.train.latest_checkpoint(directory)
  return (int(tf.train.load_variable(latest, "epoch/.ATTRIBUTES/"
                                     "VARIABLE_VALUE")) if latest else None)


# ----------------------------------------------------------- bad inputs


@bad_input
def model_dir_not_a_directory(t: Table) -> None:
  a_file = t.dir("a_file")
  open(a_file, "w").close()
  for path, needle, case in (
      (a_file, "is a regular file", "--model_dir is a regular file"),
      (os.path.join(a_file, "run"), "cannot be created",
       "--model_dir cannot be created (under a file)")):
    ok, outcome = clear_error(train(path), f"model_dir={path!r}", needle)
    t.add("bad input", case, ok, outcome)


@bad_input
def errors_before_tensorflow(t: Table) -> None:
  """Errors that need no TensorFlow come before it (#29 item 6): each took
  5-23 s of loading TF first; 3 s leaves room for a loaded machine."""
  held = t.dir("held")
  lock = subprocess.Popen(
      [PY, "-c", "import sys; from tfmgpu import rundir; "
       "rundir.RunLock(sys.argv[1]).acquire(); print(flush=True); "
       "sys.stdin.readline()", held], env=ENV, text=True,
      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  lock.stdout.readline()  # Held.
  cases = (
      ("a held run.lock", ["-m", "tfmgpu.train", *BASE,
                           f"--model_dir={held}"], "in use by a live run"),
      ("--num_stages=9 for mlp's 4 blocks",
       ["-m", "tfmgpu.train", *BASE, "--strategy=pipeline", "--num_stages=9",
        f"--model_dir={t.dir('stages')}"], "Use num_stages<=4"),
      ("--model_path that does not exist",
       ["-m", "tfmgpu.predict", f"--model_path={t.dir('none.keras')}"],
       "does not exist"))
  try:
    for case, args, needle in cases:
      start = time.monotonic()
      ok, outcome = clear_error(run([PY, *args]), needle)
      seconds = time.monotonic() - start
      t.add("bad input", f"{case}: said before TensorFlow loads (#29 item 6)",
            ok and seconds < 3, f"{outcome} in {seconds:.1f} s")
  finally:
    lock.communicate("", timeout=TIMEOUT_S)


@bad_input
def changed_settings_on_resume(t: Table) -> None:
  d = t.dir("changed")
  train(d, "--epochs=1")
  for flag, old in (("--seed=1", "seed: 0 -> 1"),
                    ("--model=convnet", "model: 'mlp' -> 'convnet'"),
                    ("--global_batch_size=32", "global_batch_size: 64 -> 32"),
                    ("--optimizer=sgd", "optimizer: 'adam' -> 'sgd'"),
                    ("--strategy=pipeline", "placement: 'data_parallel'")):
    ok, outcome = clear_error(train(d, flag), old, "use a new --model_dir")
    t.add("bad input", f"resume with {flag}", ok, outcome)


@bad_input
def diverging_learning_rate_then_the_advice(t: Table) -> None:
  d = t.dir("nan")
  train(d, "--epochs=1")
  nan = train(d, "--learning_rate=1e9")
  ok, outcome = clear_error(nan, "last good checkpoint is", "ckpt-1",
                            "Lower the learning rate")
  lowered = train(d, "--learning_rate=0.002")
  t.add("bad input", "--learning_rate=1e9 after epoch 1, then the advice "
        "(lower it) on resume (#16 item 5)", ok and t.exact(lowered),
        f"{outcome}; resumed with 0.002: weights "
        f"{'equal' if t.exact(lowered) else 'DIFFER'}")


def _npz(path: str, **changes) -> str:
  rng = np.random.default_rng(0)
  arrays = dict(x_train=rng.random((64, 8), np.float32),
                y_train=rng.integers(0, 3, 64), x_test=rng.random(
                    (8, 8), np.float32), y_test=rng.integers(0, 3, 8))
  arrays.update(changes)
  np.savez(path, **arrays)
  return path


@bad_input
def bad_npz(t: Table) -> None:
  good = _npz(t.dir("good.npz"))
  data = open(good, "rb").read()
  cases = {"empty": b"", "garbage": os.urandom(500),
           "truncated": data[:len(data) // 2]}
  for how, content in cases.items():
    path = t.dir(f"{how}.npz")
    open(path, "wb").write(content)
    ok, outcome = clear_error(
        train(t.dir(f"npz_{how}"), "--dataset=npz", f"--data_path={path}"),
        f"path={path!r} is not a valid .npz file")
    t.add("bad input", f"{how} .npz file", ok, outcome)
  y = np.zeros(64, np.int64)
  y[5] = -1
  path = _npz(t.dir("labels.npz"), y_train=y)
  ok, outcome = clear_error(
      train(t.dir("npz_labels"), "--dataset=npz", f"--data_path={path}",
            "--global_batch_size=16"), "y_train[5]=-1 is outside the class "
      "range")
  t.add("bad input", "a label outside the class range", ok, outcome)


@bad_input
def bad_keras_file(t: Table) -> None:
  data = open(t.model, "rb").read()
  truncated = t.dir("truncated.keras")
  open(truncated, "wb").write(data[:len(data) // 2])
  corrupt = t.dir("corrupt.keras")
  with zipfile.ZipFile(t.model) as good, zipfile.ZipFile(corrupt, "w") as out:
    for name in good.namelist():
      out.writestr(name, b"garbage" if name.endswith(".h5")
                   else good.read(name))
  for how, path in (("truncated", truncated), ("corrupt weights in a", corrupt)):
    ok, outcome = clear_error(predict(f"--model_path={path}"),
                              f"model_path={path!r} is not a valid .keras")
    t.add("bad input", f"predict: {how} .keras file", ok, outcome)


@bad_input
def predict_output_is_a_directory(t: Table) -> None:
  started = time.monotonic()
  result = predict(f"--model_path={t.model}", f"--output={t.work}")
  ok, outcome = clear_error(result, f"--output={t.work!r} is a directory")
  t.add("bad input", "predict --output is a directory (said before "
        "predicting)", ok and "predicted" not in result.out,
        f"{outcome} ({time.monotonic() - started:.1f} s)")


@bad_input
def tf_config_worker_string(t: Table) -> None:
  env = dict(ENV, TF_CONFIG=json.dumps({"cluster": {"worker": "localhost:2222"},
                                        "task": {"type": "worker",
                                                 "index": 0}}))
  result = run([PY, "-m", "tfmgpu.train", "--strategy=multi_worker_mirrored",
                f"--model_dir={t.dir('tfc')}"], env=env)
  ok, outcome = clear_error(result, "job 'worker' the string "
                            "'localhost:2222'", '["localhost:2222"]')
  t.add("bad input", "TF_CONFIG worker list given as a string", ok, outcome)


@bad_input
def corrupt_run_record(t: Table) -> None:
  d = t.dir("record")
  train(d, "--epochs=1")
  open(os.path.join(d, "run.json"), "w").write("{not json")
  ok, outcome = clear_error(train(d), "run.json is not a readable run record")
  t.add("bad input", "a damaged run.json", ok, outcome)


def _shards(t: Table, name: str) -> str:
  """The digits as 4 shards per split, written by the script, in $W/name."""
  directory = t.dir(name)
  written = run([PY, os.path.join(ROOT, "scripts", "write_tfrecords.py"),
                 "--dataset=digits", f"--output_dir={directory}",
                 "--num_shards=4"])
  assert written.code == 0, written.err[-2000:]
  return directory


def _damage_shard(path: str, how: str) -> None:
  data = open(path, "rb").read()
  record = len(data) // 250  # 1000 digits / 4 shards, records of one size.
  damaged = {"emptied": b"", "cut at a record boundary": data[:-record],
             "cut mid-record": data[:-record // 2],
             "with 8 flipped bytes": data[:len(data) // 2] + bytes(
                 b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 8])
             + data[len(data) // 2 + 8:]}
  if how == "deleted":
    os.remove(path)
  else:
    open(path, "wb").write(damaged[how])


@bad_input
def damaged_tfrecord_shards(t: Table) -> None:
  """#29 item 1: predict exited 0 short of rows, or a DataLossError."""
  for i, how in enumerate(("deleted", "emptied", "cut at a record boundary",
                           "cut mid-record", "with 8 flipped bytes")):
    directory = _shards(t, f"shards_{i}")
    shard = os.path.join(directory, "test-00001-of-00004.tfrecord")
    _damage_shard(shard, how)
    ok, outcome = clear_error(predict(
        f"--model_path={t.model}", "--dataset=tfrecord",
        f"--data_path={directory}/*.tfrecord"),
        f"TFRecord shard {shard} is damaged")
    t.add("bad input", f"predict: a TFRecord shard {how} (#29 item 1)", ok,
          outcome)
  directory = _shards(t, "shards_train")
  shard = os.path.join(directory, "train-00002-of-00004.tfrecord")
  _damage_shard(shard, "with 8 flipped bytes")
  data = ("--dataset=tfrecord", f"--data_path={directory}/*.tfrecord")
  ok, outcome = clear_error(train(t.dir("tfr_damaged"), *data),
                            f"TFRecord shard {shard} is damaged",
                            "--skip_damaged_shards")
  skipped = train(t.dir("tfr_skip"), *data, "--skip_damaged_shards")
  logged = f"Skipping damaged TFRecord shard {shard}" in skipped.err
  t.add("bad input", "train: a TFRecord shard with 8 flipped bytes, then "
        "with --skip_damaged_shards (#29 item 1)", ok and logged and
        skipped.code == 0, f"{outcome}; with the option: exit {skipped.code}, "
        f"skip logged: {logged}")


@bad_input
def run_record_gaps(t: Table) -> None:
  """#29 item 3: `{}`, a deleted run.json, micro_batches."""
  d = t.dir("record_blank")
  train(d, "--epochs=1")
  open(os.path.join(d, "run.json"), "w").write("{}")
  ok, outcome = clear_error(train(d, "--seed=1"), "names none of the settings",
                            "Delete it to resume")
  t.add("bad input", "resume with --seed=1 over a run.json of {} (#29 item 3)",
        ok, outcome)
  d = t.dir("record_gone")
  train(d, "--epochs=1")
  os.remove(os.path.join(d, "run.json"))
  ok, outcome = clear_error(train(d, "--model=convnet"), "has no run.json",
                            "model='convnet'", "ckpt-1 (")
  recorded = os.path.exists(os.path.join(d, "run.json"))
  again = train(d)
  t.add("bad input", "run.json deleted, resume with --model=convnet, then "
        "the right command (#29 item 3)", ok and not recorded and
        t.exact(again), f"{outcome}; run.json written: {recorded}; the right "
        f"command: weights {'equal' if t.exact(again) else 'DIFFER'}")
  d = t.dir("record_micro")
  pipeline = ("--strategy=pipeline", "--virtual_devices=2")
  train(d, *pipeline, "--epochs=1")
  ok, outcome = clear_error(train(d, *pipeline, "--micro_batches=2"),
                            "micro_batches: 4 -> 2")
  t.add("bad input", "resume a pipeline with --micro_batches=2 (#29 item 3)",
        ok, outcome)


def table(rows: list[Row]) -> str:
  lines = ["| # | kind | case | outcome | held |", "|---|---|---|---|---|"]
  for i, row in enumerate(rows, 1):
    held = {True: "yes", False: "**no**", None: "skipped"}[row.held]
    outcome = row.outcome.replace("|", "\\|")
    lines.append(f"| {i} | {row.kind} | {row.case} | {outcome} | {held} |")
  return "\n".join(lines)


def summary(rows: list[Row]) -> str:
  faults = [r for r in rows if r.kind == "fault" and r.held is not None]
  bad = [r for r in rows if r.kind == "bad input" and r.held is not None]
  skipped = sum(r.held is None for r in rows)
  return (f"{len(faults)} injected, {sum(r.held for r in faults)} survived "
          f"with nothing lost; {len(bad)} bad inputs, "
          f"{sum(r.held for r in bad)} clear errors"
          + (f" ({skipped} skipped)" if skipped else ""))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="skip the cluster cases (launcher, 2-4 processes)")
  parser.add_argument("--keep", action="store_true",
                      help="keep the work directory (printed)")
  parser.add_argument("--only", default="",
                      help="run only the cases whose function name has one "
                      "of these (comma-separated)")
  args = parser.parse_args()
  work = tempfile.mkdtemp(prefix="tfmgpu-faults-")
  started = time.monotonic()
  try:
    t = Table(work, args.quick)
    for case in FAULTS + BAD_INPUTS:
      if any(o in case.__name__ for o in args.only.split(",")):
        case(t)
  finally:
    if args.keep:
      print(f"work directory: {work}", file=sys.stderr)
    else:
      shutil.rmtree(work, ignore_errors=True)
  print(table(t.rows))
  print()
  print(summary(t.rows))
  print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
  return 0 if all(r.held is not False for r in t.rows) else 1


if __name__ == "__main__":
  sys.exit(main())
