"""`tfmgpu.in_graph` without a cluster: a serving task's end, the chief's
choice of devices before it connects (the 2-worker runs are in
tests/cluster/test_multi_worker.py)."""

import json
import os
import socket
import subprocess
import sys
import threading

from tfmgpu import in_graph

CLUSTER = {"chief": ["h0:1"], "worker": ["h1:2", "h2:3"]}


def test_the_chief_drives_the_tasks_of_its_cluster_in_order():
  assert in_graph.client_task(CLUSTER) == "chief:0"
  assert in_graph.client_task({"worker": ["a:1", "b:2"]}) == "worker:0"
  assert in_graph.tasks_of(CLUSTER) == ["chief:0", "worker:0", "worker:1"]


def test_a_serving_task_ends_as_the_chief_says(tmp_path):
  sigterm = threading.Event()
  exit_file = tmp_path / in_graph.EXIT_FILE
  exit_file.write_text("42\nerror: Preempted: SIGTERM reached this")
  # Not yet whole (no end mark): the task keeps waiting, then reads it.
  threading.Timer(0.3, lambda: exit_file.write_text(
      "42\nerror: Preempted: SIGTERM reached this process.\n--\n")).start()
  code, message = in_graph._wait_for_chief(  # pylint: disable=protected-access
      str(tmp_path), "127.0.0.1:1", "worker:0", 30, sigterm)
  assert code == 42
  assert message == ("from the chief (worker:0): error: Preempted: SIGTERM "
                     "reached this process.")


def test_a_serving_task_stops_when_the_chief_never_comes_up(tmp_path):
  ports = []
  for _ in range(2):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      ports.append(f"127.0.0.1:{s.getsockname()[1]}")
  code = ("import sys; from tfmgpu import in_graph; sys.exit(in_graph.serve("
          f"{{'worker': {ports!r}}}, 'worker:1', timeout_s=1))")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(tmp_path))
  done = subprocess.run([sys.executable, "-c", code], env=env,
                        capture_output=True, text=True, timeout=120,
                        check=False)
  assert done.returncode == 1, done.stderr[-3000:]
  assert (f"the chief (worker:0 at {ports[0]}) did not come up within "
          "connect_timeout_s=1 s") in done.stderr
  assert os.listdir(tmp_path) == []  # Its working directory is removed.


def test_planned_devices_read_the_cluster_before_connecting(monkeypatch):
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": {"worker": ["a:1", "b:2"]},
       "task": {"type": "worker", "index": 0}}))
  assert in_graph.planned_devices() == [
      "/job:worker/replica:0/task:0/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:0"]
