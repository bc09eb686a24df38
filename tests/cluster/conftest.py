"""Cluster test fixtures: no leftover process; the shared 2-worker run."""

import time

import psutil
import pytest

from tests.cluster import helpers


@pytest.fixture(autouse=True)
def no_leftover_processes():
  yield
  deadline = time.monotonic() + 10
  while True:
    alive = [p for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE]
    if not alive or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  for proc in alive:
    proc.kill()
  assert not alive, f"processes left behind: {alive}"


@pytest.fixture(scope="session")
def uninterrupted_mwms(tmp_path_factory):
  """The 2-worker multi_worker_mirrored run of MWMS_ARGS, once per session."""
  root = tmp_path_factory.mktemp("mwms")
  model_dir = root / "run"
  tmpdir = root / "worker_tmp"
  start = time.perf_counter()
  result, text = helpers.run_cluster(
      ["--strategy=multi_worker_mirrored", "--virtual_devices=2",
       f"--model_dir={model_dir}", *helpers.MWMS_ARGS],
      num_workers=2, tmpdir=str(tmpdir))
  return {"result": result, "text": text, "model_dir": model_dir,
          "tmpdir": tmpdir, "seconds": time.perf_counter() - start}
