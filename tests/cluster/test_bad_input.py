"""Bad cluster input fails before training, with the message and exit code 1.

`tfmgpu.cluster.preflight` reads TF_CONFIG before TensorFlow loads; the train
CLI prints its error and exits 1.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

from absl.testing import flagsaver
import pytest

from tfmgpu import cluster
from tfmgpu import train
from tfmgpu.config import TrainConfig
from tfmgpu.ports import PortInUseError
from tests.cluster import helpers

MWMS = TrainConfig(strategy="multi_worker_mirrored")
PS = TrainConfig(strategy="parameter_server")


def tf_config(cluster_spec, task_type="worker", index=0) -> str:
  return json.dumps({"cluster": cluster_spec,
                     "task": {"type": task_type, "index": index}})


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@pytest.fixture
def busy_port():
  """A port another "process" listens on."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]


pytestmark = pytest.mark.usefixtures("parsed_flags")


TWO_WORKERS = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
PS_CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
              "ps": ["127.0.0.1:3"]}


@pytest.mark.parametrize("config,raw,match", [
    (MWMS, "{not json", r"TF_CONFIG is not valid JSON"),
    (MWMS, json.dumps({"task": {"type": "worker"}}),
     r"TF_CONFIG needs a 'cluster' object"),
    (MWMS, tf_config(TWO_WORKERS, index=2),
     r"TF_CONFIG task index 2 is out of range: job 'worker' has 2 task\(s\) "
     r"\(indices 0..1\)"),
    (MWMS, tf_config(TWO_WORKERS, index=-1), r"task index -1 is out of range"),
    (MWMS, tf_config(TWO_WORKERS, "chief"),
     r"task type 'chief' is not a job of the cluster \(worker\)"),
    (MWMS, json.dumps({"cluster": TWO_WORKERS}),
     r"TF_CONFIG has a cluster but no task: add e\.g\. \"task\""),
    (MWMS, tf_config(PS_CLUSTER, "worker"),
     r"TF_CONFIG has job\(s\) 'ps', which strategy='multi_worker_mirrored' "
     r"does not use .*use --strategy=parameter_server"),
    (PS, tf_config({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}),
     r"needs 'chief' \(the coordinator\), 'worker' and 'ps' tasks; .* lacks "
     r"'chief'\. With the launcher: --num_ps=1 --coordinator"),
    (PS, None, r"parameter_server' needs a cluster .* TF_CONFIG, which is "
     r"unset\. Start one with python -m tfmgpu\.launch --num_workers=2 "
     r"--num_ps=1 --coordinator -- python -m tfmgpu\.train "
     r"--strategy=parameter_server$"),
    (TrainConfig(strategy="mirrored"), tf_config(TWO_WORKERS),
     r"TF_CONFIG puts this process in a cluster \(task worker:0; worker: 2\) "
     r"but strategy='mirrored' trains on one host.*"
     r"--strategy=multi_worker_mirrored, or unset TF_CONFIG"),
    (PS.replace(cluster_resolver="slurm"), None,
     r"'parameter_server' with cluster_resolver='slurm' is not supported"),
    # Issue 16: a worker list given as a string was read as address 'l'.
    (MWMS, tf_config({"worker": "localhost:2222"}),
     r"^TF_CONFIG's cluster gives job 'worker' the string 'localhost:2222', "
     r'not a list of addresses: write "worker": \["localhost:2222"\]'),
    (MWMS, tf_config({"worker": [2222]}),
     r"^TF_CONFIG's cluster gives job 'worker' \[2222\]: it must be a list "
     r'of "host:port" strings'),
])
def test_preflight_errors(config, raw, match):
  environ = {} if raw is None else {"TF_CONFIG": raw}
  with pytest.raises(ValueError, match=match):
    cluster.preflight(config.cluster_target, environ)


def test_preflight_roles():
  port = free_port()
  spec = {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:2"],
          "ps": ["127.0.0.1:3"]}
  chief = cluster.preflight(PS.cluster_target, {"TF_CONFIG": tf_config(spec, "chief")})
  assert (chief.name, chief.runs_server) == ("chief:0", False)
  assert cluster.task_role(tf_config(spec, "ps")).runs_server
  assert cluster.task_role(tf_config(spec, "worker")).runs_server
  assert not cluster.task_role(tf_config(TWO_WORKERS, "worker", 1)).runs_server
  assert cluster.preflight(MWMS.cluster_target, {}).name == "local"  # One-worker MWMS.
  assert cluster.preflight(TrainConfig().cluster_target, {}).task_type is None


def test_own_port_in_use(busy_port):
  raw = tf_config({"worker": [f"127.0.0.1:{busy_port}", "127.0.0.1:2"]})
  with pytest.raises(PortInUseError,
                     match=rf"TF_CONFIG gives task worker:0 the address "
                     rf"127\.0\.0\.1:{busy_port}, but port {busy_port} cannot "
                     r"be bound on this machine \(Address already in use\): "
                     r"another process is using it\..*\(python -m "
                     r"tfmgpu\.launch picks free ports\)\.$"):
    cluster.preflight(MWMS, {"TF_CONFIG": raw})
  with pytest.raises(PortInUseError, match=r"address 'localhost', which has "
                     r"no valid port"):
    cluster.preflight(MWMS, {"TF_CONFIG": tf_config({"worker": ["localhost"]})})


def test_server_threads_floor():
  with pytest.raises(ValueError, match=r"inter_op_threads=2: .*deadlock"):
    cluster.run_server(cluster.TaskRole("worker", 0, PS_CLUSTER),
                       inter_op_threads=2)


@pytest.mark.parametrize("raw,message", [
    (tf_config(TWO_WORKERS, index=5), "TF_CONFIG task index 5 is out of range"),
    ("[1, 2", "TF_CONFIG is not valid JSON"),
])
def test_train_cli_exits_1_with_the_message(raw, message, monkeypatch,
                                            capsys):
  monkeypatch.setenv("TF_CONFIG", raw)
  with flagsaver.flagsaver(strategy="multi_worker_mirrored"):
    assert train.main(["train"]) == 1
  assert f"error: {message}" in capsys.readouterr().err


def test_train_cli_port_in_use(busy_port, monkeypatch, capsys):
  monkeypatch.setenv("TF_CONFIG", tf_config(
      {"worker": [f"127.0.0.1:{busy_port}"]}))
  with flagsaver.flagsaver(strategy="multi_worker_mirrored"):
    assert train.main(["train"]) == 1
  assert f"port {busy_port} cannot be bound" in capsys.readouterr().err


def test_subprocess_bad_tf_config_fails_before_tensorflow_loads():
  # PYTHONPROFILEIMPORTTIME lists every import on stderr: the process must
  # fail without ever importing TensorFlow.
  env = dict(helpers.ENV, TF_CONFIG=tf_config(TWO_WORKERS, index=7),
             PYTHONPROFILEIMPORTTIME="1")
  out = subprocess.run(
      helpers.train_command("--strategy=multi_worker_mirrored"), env=env,
      capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode == 1
  assert "error: TF_CONFIG task index 7 is out of range" in out.stderr
  assert not re.search(r"\|\s*tensorflow$", out.stderr, re.M), out.stderr


def test_launcher_script_base_port_in_use(busy_port):
  script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts",
                        "launch_local_cluster.py")
  out = subprocess.run(
      [sys.executable, script, "--num_workers=2", f"--base_port={busy_port}",
       "--", *helpers.train_command("--strategy=multi_worker_mirrored")],
      env=helpers.ENV, capture_output=True, text=True, timeout=60,
      check=False)
  assert out.returncode == 1
  assert f"port {busy_port} (for task worker:0) cannot be bound" in out.stderr


@pytest.mark.slow
def test_mwms_after_tensorflow_started_says_what_to_do():
  code = textwrap.dedent(f"""
      import os
      os.environ["TF_CONFIG"] = {tf_config({"worker": [
          f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]})!r}
      import tensorflow as tf, tfmgpu
      tf.constant(1.0) + 1  # Starts the runtime.
      try:
        tfmgpu.get_strategy("multi_worker_mirrored")
      except RuntimeError as e:
        print("ERROR:", e)
      """)
  out = subprocess.run([sys.executable, "-c", code], env=helpers.ENV,
                       capture_output=True, text=True, timeout=120,
                       check=False)
  assert ("ERROR: strategy 'multi_worker_mirrored' must be created before "
          "TensorFlow starts its runtime") in out.stdout, out.stderr[-3000:]
  assert "task worker:0" in out.stdout and "restart the kernel" in out.stdout



def _missing_peer_run(timeout_s: float, model_dir) -> tuple[
    subprocess.Popen, int, int]:
  """Worker 0 of two, started alone: the train CLI, its port, its peer's."""
  own, peer = free_port(), free_port()
  env = dict(helpers.ENV, TF_CONFIG=tf_config({"worker": [
      f"127.0.0.1:{own}", f"127.0.0.1:{peer}"]}))
  proc = subprocess.Popen(  # pylint: disable=consider-using-with
      helpers.train_command("--strategy=multi_worker_mirrored",
                            "--model=mlp", "--epochs=1",
                            "--steps_per_epoch=2", "--verbose=0",
                            f"--connect_timeout_s={timeout_s:g}",
                            f"--model_dir={model_dir}"), env=env, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  return proc, own, peer


@pytest.mark.slow
def test_mwms_names_a_peer_that_never_comes_up_within_the_timeout(tmp_path):
  """TF's start-up waited for a missing peer forever, printing nothing;
  every worker now waits at most --connect_timeout_s and names it."""
  proc, _, peer = _missing_peer_run(2, tmp_path / "run")
  try:
    _, err = proc.communicate(timeout=90)
  finally:
    proc.kill()
  assert proc.returncode == 1, err[-3000:]
  assert (f"error: multi_worker_mirrored: worker:1 (127.0.0.1:{peer}: "
          "Connection refused) did not come up within connect_timeout_s=2 s, "
          "so task worker:0 stops") in err, err[-3000:]


@pytest.mark.slow
def test_sigterm_stops_a_mwms_worker_waiting_for_its_peer(tmp_path):
  """TF's C++ start-up took SIGTERM and went on waiting; the wait for the
  peers is Python's, which SIGTERM ends: exit 42 as any SIGTERM outside the
  training steps (a rerun resumes), with one line saying so."""
  proc, own, _ = _missing_peer_run(300, tmp_path / "run")
  try:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
      try:  # Its port answers once it waits (TF's server would too).
        socket.create_connection(("127.0.0.1", own), timeout=1).close()
        break
      except OSError:
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
  finally:
    proc.kill()
  assert proc.returncode == 42, err[-3000:]
  assert "SIGTERM reached this process outside the training steps" in err, (
      err[-3000:])
