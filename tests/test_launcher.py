"""Tests for tfmgpu.launcher and scripts/launch_local_cluster.py.

The tasks are tiny Python programs (no TensorFlow): `_TASK` runs the list of
actions the test gives for its task name (from TFMGPU_TASK).
"""

import io
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

from tfmgpu import launcher

_SCRIPT = (pathlib.Path(__file__).resolve().parents[1] / "scripts" /
           "launch_local_cluster.py")

# argv[1] is {"task name" or "*": ["action:arg", ...]}; "{task}" in an arg
# becomes the task name, e.g. "worker_0".
_TASK = r"""
import json, os, signal, subprocess, sys, time
name = os.environ["TFMGPU_TASK"]
plan = json.loads(sys.argv[1])
for action in plan.get(name, plan.get("*", [])):
  what, _, arg = action.partition(":")
  arg = arg.replace("{task}", name.replace(":", "_"))
  if what == "config":
    print("TF_CONFIG=" + os.environ["TF_CONFIG"])
  elif what == "echo":
    print(arg)
  elif what == "stderr":
    print(arg, file=sys.stderr)
  elif what == "partial":
    sys.stdout.write(arg)
  elif what == "child":
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"])
    print("CHILD=%d" % child.pid)
  elif what == "ignore":
    signal.signal(getattr(signal, arg), signal.SIG_IGN)
  elif what == "touch":
    open(arg, "w").close()
  elif what == "wait":
    deadline = time.monotonic() + 20
    while not os.path.exists(arg) and time.monotonic() < deadline:
      time.sleep(0.02)
  elif what == "sleep":
    time.sleep(float(arg))
  elif what == "exit":
    sys.exit(int(arg))
  elif what == "kill":
    os.kill(os.getpid(), getattr(signal, arg))
  elif what == "pid":
    open(arg, "w").write(str(os.getpid()))
  elif what == "waitpid":  # Until the task whose pid is in `arg` is reaped.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
      try:
        os.kill(int(open(arg).read()), 0)
      except (ProcessLookupError, OSError, ValueError):
        break
      time.sleep(0.02)
  elif what == "why":  # On SIGTERM, print the launcher's note, then exit.
    def on_why(signum, frame):
      with open(os.environ["TFMGPU_STOP_NOTE"]) as f:
        print("WHY=" + f.read(), flush=True)
      os._exit(143)
    signal.signal(signal.SIGTERM, on_why)
  elif what == "trap":  # trap:FILE:CODE:DELAY -- log SIGTERM, wait, exit.
    log, code, delay = arg.rsplit(":", 2)
    def on_term(signum, frame, log=log, code=int(code), delay=float(delay)):
      with open(log, "a") as f:
        f.write(name + " got SIGTERM\n")
      time.sleep(delay)
      with open(log, "a") as f:
        f.write(name + " exits\n")
      os._exit(code)
    signal.signal(signal.SIGTERM, on_term)
"""

# Tasks that wait to be stopped sleep this long: a launch that returns sooner
# stopped them instead of waiting for them. (No tighter wall-clock bound: the
# cores are shared.)
_SLEEP_S = 60
_SLEEP = f"sleep:{_SLEEP_S}"


def _launch(plan, **kwargs):
  """Runs `_TASK` with `plan` on every task; returns (result, output)."""
  out = io.StringIO()
  kwargs.setdefault("num_workers", 2)
  kwargs.setdefault("timeout_s", 30)
  kwargs.setdefault("grace_s", 5)
  result = launcher.launch([sys.executable, "-c", _TASK, json.dumps(plan)],
                           output=out, **kwargs)
  return result, out.getvalue()


def _gone(pid: int) -> bool:
  """Whether `pid` no longer runs (orphans may stay zombies in containers)."""
  try:
    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return True


def _child_pids(output: str) -> list[int]:
  return [int(line.rsplit("CHILD=", 1)[1]) for line in output.splitlines()
          if "CHILD=" in line]


@pytest.fixture(autouse=True)
def no_leftover_children():
  yield
  alive = [p for p in psutil.Process().children(recursive=True)
           if p.status() != psutil.STATUS_ZOMBIE]
  assert not alive, f"processes left behind: {alive}"


@pytest.mark.parametrize("num_workers,num_ps,chief,jobs", [
    (1, 0, False, {"worker": 1}),
    (3, 0, True, {"chief": 1, "worker": 3}),
    (2, 2, True, {"chief": 1, "worker": 2, "ps": 2}),
])
def test_make_cluster_picks_distinct_free_ports(num_workers, num_ps, chief,
                                                jobs):
  cluster = launcher.make_cluster(num_workers, num_ps=num_ps, chief=chief)

  assert {job: len(addrs) for job, addrs in cluster.items()} == jobs
  assert list(cluster) == [t for t in launcher.TASK_TYPES if t in jobs]
  addresses = [a for addrs in cluster.values() for a in addrs]
  hosts = {a.rsplit(":", 1)[0] for a in addresses}
  ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
  assert hosts == {"127.0.0.1"}
  assert len(set(ports)) == len(ports)
  for port in ports:
    with socket.socket() as sock:
      sock.bind(("", port))  # Still free.


def test_base_port_in_use_names_the_port():
  with socket.socket() as busy:
    busy.bind(("", 0))
    busy.listen()
    port = busy.getsockname()[1]
    with pytest.raises(launcher.PortInUseError,
                       match=rf"base_port={port}: port {port} \(for task "
                       r"worker:0\) cannot be bound.*Choose another base_port"):
      launcher.make_cluster(2, base_port=port)
    with pytest.raises(launcher.PortInUseError, match=f"port {port}"):
      _launch({"*": ["exit:0"]}, base_port=port)


def test_tf_config_for():
  cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}

  assert json.loads(launcher.tf_config_for(cluster, "worker", 1)) == {
      "cluster": cluster, "task": {"type": "worker", "index": 1}}
  with pytest.raises(ValueError, match=r"task_type='chief' is not a job of "
                     r"this cluster. Available: \['ps', 'worker'\]"):
    launcher.tf_config_for(cluster, "chief", 0)
  with pytest.raises(ValueError, match=r"index=1 is out of range for "
                     r"task_type='ps', which has 1 task\(s\): use 0..0"):
    launcher.tf_config_for(cluster, "ps", 1)


@pytest.mark.parametrize("kwargs,message", [
    ({"num_workers": 0}, "num_workers=0 is invalid: a cluster needs at least "
     "one worker task. Use an integer >= 1."),
    ({"num_workers": -2}, "num_workers=-2 is invalid"),
    ({"num_ps": -1}, "num_ps=-1 is invalid"),
    ({"base_port": 70000}, "base_port=70000 is invalid"),
    ({"timeout_s": 0}, "timeout_s=0 is invalid: use a number of seconds > 0"),
    ({"grace_s": -1}, "grace_s=-1 is invalid"),
    ({"command": []}, "command=[] is invalid: give the program"),
    ({"command": "python x.py"}, "command='python x.py' is invalid"),
    ({"command": ["/no/such/program"]},
     "command[0]='/no/such/program' is not an executable file or on PATH"),
])
def test_invalid_arguments_are_named(kwargs, message):
  kwargs = {"num_workers": 2, "timeout_s": 5, **kwargs}
  command = kwargs.pop("command", [sys.executable, "-c", "pass"])
  with pytest.raises(ValueError, match="^" + re.escape(message)):
    launcher.launch(command, output=io.StringIO(), **kwargs)


def test_every_task_sees_the_cluster_and_its_own_task(tmp_path):
  lines = ["config", "echo:second line", "stderr:to stderr",
           "partial:no newline"]
  # The run ends when the coordinator (chief) does: let it wait for the rest.
  result, output = _launch(
      {"chief:0": [*lines, *(f"wait:{tmp_path}/{t}"
                             for t in ("worker_0", "worker_1", "ps_0"))],
       "*": [*lines, f"touch:{tmp_path}/{{task}}"]},
      num_workers=2, num_ps=1, chief=True)

  assert result.exit_code == 0, output
  assert result.outcome == launcher.Outcome.SUCCEEDED
  names = ["chief:0", "worker:0", "worker:1", "ps:0"]
  assert list(result.task_exit_codes) == names
  seen = {}
  for line in output.splitlines():
    assert line.startswith(tuple(f"[{n}] " for n in names + ["launcher"]))
    name, _, text = line[1:].partition("] ")
    if text.startswith("TF_CONFIG="):
      seen[name] = json.loads(text[len("TF_CONFIG="):])
  assert sorted(seen) == sorted(names)
  for name, config in seen.items():
    task_type, index = name.split(":")
    assert config == {"cluster": result.cluster,
                      "task": {"type": task_type, "index": int(index)}}
  for name in names:
    for text in ("second line", "to stderr", "no newline"):
      assert f"[{name}] {text}\n" in output


@pytest.mark.parametrize("action,task_code,exit_code,message", [
    ("exit:3", 3, 3, "Task worker:1 exited with code 3."),
    ("kill:SIGKILL", -9, 137,
     "Task worker:1 was killed by signal SIGKILL (9)."),
])
def test_failed_task_stops_the_others(tmp_path, action, task_code, exit_code,
                                      message):
  ready = str(tmp_path / "ready")
  result, output = _launch({"worker:0": ["child", f"touch:{ready}", _SLEEP],
                            "worker:1": [f"wait:{ready}", action]})

  assert result.exit_code == exit_code, output
  assert result.outcome == launcher.Outcome.TASK_FAILED
  assert result.first_failure == "worker:1"
  assert message + " Stopping the other tasks: worker:0." in output
  assert result.task_exit_codes == {"worker:0": -signal.SIGTERM,
                                    "worker:1": task_code}
  assert result.stopped == ("worker:0",)
  assert result.duration_s < _SLEEP_S
  children = _child_pids(output)
  assert len(children) == 1
  assert all(_gone(pid) for pid in [*result.pids.values(), *children])


@pytest.mark.parametrize("plan,why", [
    ({"worker:1": ["wait:{ready}", "exit:3"]}, "worker:1 exited with code 3"),
    ({"worker:1": ["why", _SLEEP]}, "its timeout_s=3 elapsed")])
def test_stopped_tasks_are_told_why(tmp_path, plan, why):
  """A task stopped after a peer failed logged "SIGTERM received" as for a
  preemption notice; the launcher now writes why (`tfmgpu.stop_notes`)
  before its SIGTERM, and removes the note at the end."""
  ready = str(tmp_path / "ready")
  plan["worker:1"] = [a.replace("{ready}", ready) for a in plan["worker:1"]]
  _, output = _launch({"worker:0": ["why", f"touch:{ready}", _SLEEP], **plan},
                      timeout_s=3)
  assert f"[worker:0] WHY={why}\n" in output
  assert not list(pathlib.Path(tempfile.gettempdir()).glob(
      f"tfmgpu-stop-{os.getpid()}-*"))


def test_task_ignoring_sigterm_is_killed_after_grace(tmp_path):
  ready = str(tmp_path / "ready")
  result, output = _launch(
      {"worker:0": ["ignore:SIGTERM", f"touch:{ready}", _SLEEP],
       "worker:1": [f"wait:{ready}", "exit:1"]}, grace_s=1)

  assert result.exit_code == 1, output
  assert ("grace_s=1 elapsed and worker:0 still running after SIGTERM; "
          "sending SIGKILL.") in output
  assert result.task_exit_codes["worker:0"] == -signal.SIGKILL
  assert result.duration_s < _SLEEP_S
  assert _gone(result.pids["worker:0"])


@pytest.mark.parametrize("chief,plan,stopped", [
    # No coordinator: the workers do the work, the ps task serves forever.
    (False, {"worker:0": ["exit:0"], "worker:1": ["exit:0"],
             "ps:0": [_SLEEP]}, ("ps:0",)),
    # With a coordinator (chief), workers are servers too, as in TF.
    (True, {"chief:0": ["sleep:0.5", "exit:0"], "*": [_SLEEP]},
     ("worker:0", "worker:1", "ps:0")),
])
def test_servers_are_stopped_after_the_work_succeeds(chief, plan, stopped):
  result, output = _launch(plan, num_workers=2, num_ps=1, chief=chief)

  assert result.exit_code == 0, output
  assert result.outcome == launcher.Outcome.SUCCEEDED
  assert result.first_failure is None
  assert result.stopped == stopped
  assert all(result.task_exit_codes[n] == -signal.SIGTERM for n in stopped)
  assert ("succeeded; stopping the server tasks, which never exit on their "
          f"own: {', '.join(stopped)}.") in output
  assert result.duration_s < _SLEEP_S
  assert all(_gone(pid) for pid in result.pids.values())


def test_timeout_stops_everything():
  result, output = _launch({"*": ["child", _SLEEP]}, timeout_s=2)

  assert result.exit_code == launcher.EXIT_TIMEOUT, output
  assert result.outcome == launcher.Outcome.TIMED_OUT
  assert ("Timed out: timeout_s=2 elapsed with 2 task(s) still running: "
          "worker:0, worker:1. Stopping them.") in output
  assert result.stopped == ("worker:0", "worker:1")
  assert 2 <= result.duration_s < _SLEEP_S
  children = _child_pids(output)
  assert len(children) == 2
  assert all(_gone(pid) for pid in [*result.pids.values(), *children])


@pytest.mark.parametrize("sig,exit_code", [(signal.SIGINT, 130),
                                           (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_tasks(sig, exit_code):
  handler = signal.getsignal(sig)
  timer = threading.Timer(1.5, os.kill, (os.getpid(), sig))
  timer.start()
  try:
    result, output = _launch({"*": [_SLEEP]}, timeout_s=20)
  finally:
    timer.cancel()

  assert result.exit_code == exit_code, output
  assert result.outcome == launcher.Outcome.INTERRUPTED
  assert f"Received {sig.name}; stopping all tasks." in output
  assert result.stopped == ("worker:0", "worker:1")
  assert result.duration_s < _SLEEP_S
  assert all(_gone(pid) for pid in result.pids.values())
  assert signal.getsignal(sig) is handler


@pytest.mark.slow
def test_script_end_to_end():
  proc = subprocess.run(
      [sys.executable, str(_SCRIPT), "--num_workers=2", "--timeout_s=60",
       "--", sys.executable, "-c",
       "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
       "print(os.environ['TFMGPU_TASK'], len(c['cluster']['worker']))"],
      capture_output=True, text=True, timeout=60, check=False)

  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "[worker:0] worker:0 2\n" in proc.stdout
  assert "[worker:1] worker:1 2\n" in proc.stdout
  assert "exit code 0 (succeeded)" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--num_workers=2"], "No command given. Put the command every task runs "
     "after '--'"),
    (["--base_port=65535", "--", sys.executable, "-c", "pass"],
     "base_port=65535 is invalid"),
])
def test_script_usage_errors(args, message):
  proc = subprocess.run([sys.executable, str(_SCRIPT), *args],
                        capture_output=True, text=True, timeout=60,
                        check=False)

  assert proc.returncode != 0
  assert message in proc.stderr


# ------------------------------------------- parameter-server semantics


def test_parameter_servers_go_on_without_a_lost_worker(tmp_path):
  pid = str(tmp_path / "worker_1.pid")
  result, output = _launch(
      {"chief:0": [f"wait:{pid}", f"waitpid:{pid}", "exit:0"],
       "worker:1": [f"pid:{pid}", "kill:SIGKILL"], "*": [_SLEEP]},
      num_workers=2, num_ps=1, chief=True)

  assert result.exit_code == 0, output
  assert result.outcome == launcher.Outcome.SUCCEEDED
  assert result.lost == ("worker:1",)
  assert result.first_failure is None
  assert ("Task worker:1 was killed by signal SIGKILL (9). Parameter-server "
          "training goes on without it: the coordinator reschedules its "
          "steps on the other workers (worker:0).") in output
  assert result.stopped == ("worker:0", "ps:0")
  assert result.duration_s < _SLEEP_S


def test_losing_every_worker_stops_a_parameter_server_run():
  result, output = _launch(
      {"chief:0": [_SLEEP], "ps:0": [_SLEEP], "*": ["kill:SIGKILL"]},
      num_workers=2, num_ps=1, chief=True)

  assert result.exit_code == 128 + signal.SIGKILL, output
  assert result.outcome == launcher.Outcome.TASK_FAILED
  assert "No worker is left to run the coordinator's steps." in output
  assert set(result.stopped) == {"chief:0", "ps:0"}
  assert all(_gone(pid) for pid in result.pids.values())


def test_parameter_servers_stop_coordinator_first_and_ps_last(tmp_path):
  log = str(tmp_path / "log")
  ready = [str(tmp_path / f"ready_{n}") for n in ("chief_0", "worker_0",
                                                  "worker_1", "ps_0")]
  plan = {"chief:0": [f"trap:{log}:42:0.5", f"touch:{ready[0]}", _SLEEP],
          "*": [f"trap:{log}:143:0", "touch:" + str(tmp_path / "ready_{task}"),
                _SLEEP]}

  def interrupt_when_ready():
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(map(os.path.exists, ready)):
      time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)

  handler = signal.getsignal(signal.SIGTERM)
  thread = threading.Thread(target=interrupt_when_ready, daemon=True)
  thread.start()
  try:
    result, output = _launch(plan, num_workers=2, num_ps=1, chief=True)
  finally:
    thread.join(35)
  assert signal.getsignal(signal.SIGTERM) is handler

  events = open(log).read().splitlines()
  assert events[:2] == ["chief:0 got SIGTERM", "chief:0 exits"], events
  workers = [e for e in events[2:-2]]
  assert sorted(workers) == ["worker:0 exits", "worker:0 got SIGTERM",
                             "worker:1 exits", "worker:1 got SIGTERM"], events
  assert events[-2:] == ["ps:0 got SIGTERM", "ps:0 exits"], events
  # The coordinator saved and exited 42: the launch says "resume me" too.
  assert result.exit_code == 42, output
  assert "Every task that trains exited with 42" in output


def test_tf_config_for_refuses_a_job_given_as_a_string():
  with pytest.raises(ValueError, match=r"cluster\['worker'\]='127\.0\.0\.1:1'"
                     r" is invalid: give a list of 'host:port' strings, e\.g\. "
                     r"\{'worker': \['127\.0\.0\.1:1'\]\}"):
    launcher.tf_config_for({"worker": "127.0.0.1:1"}, "worker", 0)


def test_help_gives_the_exit_codes_of_ctrl_c():
  # The trial's #4b: --help said "130 on Ctrl-C", but Ctrl-C to a launch
  # of `python -m tfmgpu.train` exits 42: each task saves on the launcher's
  # SIGTERM (measured; the codes: test_signal_to_launcher_stops_tasks,
  # test_parameter_servers_stop_coordinator_first_and_ps_last).
  from tfmgpu import launch  # pylint: disable=g-import-not-at-top
  text = " ".join(launch.__doc__.split())
  assert ("on Ctrl-C (or SIGTERM) the tasks are stopped with SIGTERM, and "
          "the code is 42 when every task that trains saved a checkpoint "
          "and exited 42 (python -m tfmgpu.train does: rerun to resume), "
          "else 130 (143)") in text


def test_a_task_preempted_on_its_own_is_waited_for_not_failed():
  """A SIGTERM sent to worker:1 (not the launcher): both workers saved and
  left with 42, but the launcher took worker:1's 42 for a failure and
  killed worker:0 while it was leaving (a new user's trial)."""
  plan = {"worker:1": ["exit:42"], "worker:0": ["sleep:0.5", "exit:42"]}
  result, output = _launch(plan, grace_s=10)
  assert result.exit_code == 42, output
  assert result.outcome == launcher.Outcome.INTERRUPTED
  assert result.stopped == () and result.first_failure is None
  assert ("worker:1 exited with 42 (stopped by a signal after saving a "
          "checkpoint) and every task that trains did the same" in output)
  # One that does not follow within grace_s fails the run as before.
  plan = {"worker:1": ["exit:42"], "worker:0": [_SLEEP]}
  result, output = _launch(plan, grace_s=0.5)
  assert result.outcome == launcher.Outcome.TASK_FAILED, output
  assert result.stopped == ("worker:0",)


def test_a_crash_while_waiting_for_preempted_tasks_is_named():
  """worker:0 saved and left (42), then worker:1 crashed: the crash is the
  run's failure, not worker:0's 42 (a reviewer's scenario)."""
  plan = {"worker:0": ["exit:42"], "worker:1": ["sleep:0.3", "exit:3"]}
  result, output = _launch(plan, grace_s=20)
  assert result.outcome == launcher.Outcome.TASK_FAILED, output
  assert (result.exit_code, result.first_failure) == (3, "worker:1"), output
  assert result.duration_s < 15  # Not the whole grace period.
