"""multi_worker_mirrored with `--cluster_resolver=slurm`, under a faked srun.

Two local processes get the environment `srun --ntasks=2` gives two tasks
on one node; TF's SlurmClusterResolver then puts them on ports 8888-8889.
"""

import os
import socket
import subprocess

import pytest

from tests.cluster import helpers

pytestmark = pytest.mark.slow

PORTS = (8888, 8889)  # SlurmClusterResolver's default port_base, 2 tasks.


def _ports_free() -> bool:
  for port in PORTS:
    with socket.socket() as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        sock.bind(("", port))
      except OSError:
        return False
  return True


def test_two_srun_tasks_on_a_cpu_node_train_together(tmp_path):
  if not _ports_free():
    pytest.skip(f"ports {PORTS} are in use")
  procs = []
  try:
    for rank in range(2):
      env = dict(helpers.ENV, SLURM_JOB_ID="4242", SLURM_PROCID=str(rank),
                 SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
                 SLURM_STEP_TASKS_PER_NODE="2")
      env.pop("CUDA_VISIBLE_DEVICES", None)
      procs.append(subprocess.Popen(
          helpers.train_command(
              "--strategy=multi_worker_mirrored", "--cluster_resolver=slurm",
              "--epochs=1", "--steps_per_epoch=4", "--verbose=0",
              f"--model_dir={tmp_path / 'run'}"),
          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          text=True, start_new_session=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait(10)
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  for rank, out in enumerate(outputs):
    assert (f"2 on /job:worker/replica:0/task:{rank}/device:CPU:0" in out), out
  digests = [helpers.summary_value("\n".join(f"[t] {l}" for l in o.splitlines()),
                                   "t", "weights sha256") for o in outputs]
  assert digests[0] == digests[1]
  assert (tmp_path / "run" / "model.keras").exists()
