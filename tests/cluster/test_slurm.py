"""multi_worker_mirrored with `--cluster_resolver=slurm`, under a faked srun.

Two local processes get the environment `srun --ntasks=2` gives two tasks
on one node; TF's SlurmClusterResolver then puts them on ports port_base and
port_base + 1. Its port_base (8888 unless set) is set in each task to the
first of two free ports the test picks, so busy ports never skip the test.
"""

import contextlib
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.cluster import helpers

pytestmark = pytest.mark.slow

# `python -m tfmgpu.train`, with SlurmClusterResolver's port_base from
# PORT_BASE (the only change: the resolver has no environment variable for it).
_TRAIN_WITH_PORT_BASE = textwrap.dedent("""
    import functools, os, runpy
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver
    resolver.__init__ = functools.partialmethod(
        resolver.__init__, port_base=int(os.environ["PORT_BASE"]))
    runpy.run_module("tfmgpu.train", run_name="__main__", alter_sys=True)
""")


def _free_port_pair(attempts: int = 100) -> int:
  """A free port (bound as port 0) whose next port is free too."""
  for _ in range(attempts):
    with contextlib.ExitStack() as stack:
      first = stack.enter_context(socket.socket())
      first.bind(("", 0))
      base = first.getsockname()[1]
      try:
        stack.enter_context(socket.socket()).bind(("", base + 1))
      except (OSError, OverflowError):
        continue
      return base
  raise AssertionError(f"no two consecutive free ports in {attempts} tries")


def test_two_srun_tasks_on_a_cpu_node_train_together(tmp_path):
  port_base = _free_port_pair()
  procs = []
  try:
    for rank in range(2):
      env = dict(helpers.ENV, SLURM_JOB_ID="4242", SLURM_PROCID=str(rank),
                 SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
                 SLURM_STEP_TASKS_PER_NODE="2", PORT_BASE=str(port_base))
      env.pop("CUDA_VISIBLE_DEVICES", None)
      procs.append(subprocess.Popen(
          [sys.executable, "-c", _TRAIN_WITH_PORT_BASE,
           "--strategy=multi_worker_mirrored", "--cluster_resolver=slurm",
           "--epochs=1", "--steps_per_epoch=4", "--verbose=0",
           f"--model_dir={tmp_path / 'run'}"],
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
