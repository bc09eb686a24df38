"""ZeRO stages 1 and 3 over two worker processes, in-graph (issue 28).

One client (task 0) drives a `ShardedModel` whose devices are one CPU in
each of two TF server processes: each weight and optimizer slot lives in
its owner's process, and training equals the unsplit run (SGD 1e-5, Adam
1e-4). This is TF's in-graph replication, as `multi_worker_mirrored
--zero_stage=N` runs it from the CLI (`tfmgpu.in_graph`; its launcher test
is in test_multi_worker.py).
"""

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.cluster import helpers

pytestmark = pytest.mark.slow
CLIENT = os.path.join(os.path.dirname(__file__), "zero_in_graph_task.py")
SERVER = ("import sys, tensorflow as tf; tf.distribute.Server("
          "tf.train.ClusterSpec({'worker': sys.argv[1:3]}), "
          "job_name='worker', task_index=1).join()")


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def test_zero_over_two_worker_processes_equals_unsplit(tmp_path):
  workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
  env = dict(helpers.ENV, PYTHONPATH=os.getcwd())
  server = subprocess.Popen([sys.executable, "-c", SERVER, *workers],
                            env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  try:
    client = subprocess.run([sys.executable, CLIENT, *workers,
                             str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=240, check=False)
  finally:
    server.kill()
    server.wait(timeout=30)
  out = client.stdout
  assert client.returncode == 0, out + client.stderr[-4000:]
  tasks = "['/job:worker/replica:0/task:0/device:CPU:0', " \
          "'/job:worker/replica:0/task:1/device:CPU:0']"
  for optimizer, tol in (("sgd", 1e-5), ("adam", 1e-4)):
    for stage in (1, 3):
      diff = re.search(rf"^{optimizer} stage {stage} maxdiff (\S+)$", out,
                       re.M)
      assert diff and float(diff.group(1)) <= tol, out
      assert f"{optimizer} stage {stage} on owner True tasks {tasks}" in out
  assert f"slot tasks {tasks}" in out, out
  assert "restored unsplit equal True" in out, out
