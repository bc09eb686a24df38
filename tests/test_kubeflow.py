"""scripts/kubeflow/tfjob.yaml: its command is a valid tfmgpu run, and the
TF_CONFIG that Kubeflow's training operator sets in each worker pod passes
tfmgpu's cluster checks and resolves to the expected roles."""

import json
import pathlib
import socket
import types

from absl import flags
from absl.testing import flagsaver
import pytest
import tensorflow as tf
import yaml

from tfmgpu import cluster
from tfmgpu import train
from tfmgpu.launcher import cluster_spec
from tfmgpu.training import checkpoints

MANIFEST = (pathlib.Path(__file__).resolve().parents[1] / "scripts" /
            "kubeflow" / "tfjob.yaml")
PORT = 2222  # The training operator's default port (container port tfjob-port).

pytestmark = pytest.mark.usefixtures("parsed_flags")


@pytest.fixture(scope="module")
def job():
  return yaml.safe_load(MANIFEST.read_text())


def worker_container(job) -> dict:
  worker = job["spec"]["tfReplicaSpecs"]["Worker"]
  (container,) = worker["template"]["spec"]["containers"]
  return container


def kubeflow_tf_config(job, index: int, port: int = PORT) -> str:
  """TF_CONFIG as the operator writes it: one service per worker pod."""
  name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
  replicas = job["spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
  return json.dumps({
      "cluster": {"worker": [f"{name}-worker-{i}.{namespace}.svc:{port}"
                             for i in range(replicas)]},
      "task": {"type": "worker", "index": index}, "environment": "cloud"})


def config_from_manifest(job):
  container = worker_container(job)
  assert container["command"] == ["python", "-m", "tfmgpu.train"]
  with flagsaver.flagsaver():
    flags.FLAGS(["tfmgpu.train", *container["args"]])
    return train.config_from_flags()


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("", 0))
    return sock.getsockname()[1]


def test_the_manifest_runs_two_multi_worker_mirrored_workers_on_tfrecords(job):
  assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
  worker = job["spec"]["tfReplicaSpecs"]["Worker"]
  assert worker["replicas"] == 2 and set(job["spec"]["tfReplicaSpecs"]) == {
      "Worker"}
  container = worker_container(job)
  assert container["name"] == "tensorflow"  # The operator looks for it.
  assert [p["containerPort"] for p in container["ports"]] == [PORT]
  config = config_from_manifest(job)
  assert (config.strategy, config.dataset, config.data_path) == (
      "multi_worker_mirrored", "tfrecord", "/data/digits/*.tfrecord")
  mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
  assert mounts["/data"]["readOnly"] and config.data_path.startswith("/data/")
  assert config.model_dir.startswith("/runs/") and "/runs" in mounts


@pytest.mark.parametrize("index", [0, 1])
def test_kubeflow_tf_config_passes_the_checks_and_gives_the_roles(
    job, index, monkeypatch):
  config = config_from_manifest(job)
  # The roles, from the manifest's own addresses (port 2222).
  role = cluster.task_role(kubeflow_tf_config(job, index))
  assert (role.name, role.runs_server) == (f"worker:{index}", False)
  assert role.address == f"tfmgpu-digits-worker-{index}.default.svc:{PORT}"
  assert role.cluster == {"worker": [
      f"tfmgpu-digits-worker-{i}.default.svc:{PORT}" for i in range(2)]}
  # Preflight also binds this task's port here: give it one that is free.
  port = free_port()
  tf_config = kubeflow_tf_config(job, index, port)
  checked = cluster.preflight(config.cluster_target, environ={"TF_CONFIG": tf_config})
  assert (checked.name, checked.index) == (f"worker:{index}", index)
  # The same cluster through the local launcher reads the same way.
  launched = cluster.task_role(cluster_spec.tf_config_for(
      checked.cluster, "worker", index))
  assert launched == checked
  # TensorFlow's resolver (what multi_worker_mirrored reads) agrees, and
  # worker 0 is the chief that writes the outputs.
  monkeypatch.setenv("TF_CONFIG", tf_config)
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  assert (resolver.task_type, resolver.task_id) == ("worker", index)
  assert resolver.cluster_spec().as_dict() == checked.cluster
  strategy = types.SimpleNamespace(cluster_resolver=resolver)
  assert checkpoints.is_chief(strategy) == (index == 0)


def test_a_kubeflow_cluster_is_refused_by_a_one_host_strategy(job):
  config = config_from_manifest(job).replace(strategy="mirrored")
  with pytest.raises(ValueError, match=r"TF_CONFIG puts this process in a "
                     r"cluster \(task worker:0; worker: 2\) but "
                     r"strategy='mirrored' trains on one host"):
    cluster.preflight(config.cluster_target, environ={
        "TF_CONFIG": kubeflow_tf_config(job, 0, free_port())})
