"""Cluster resolvers by name (`tf_config`, `slurm`) and the TF_CONFIG check.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from absl import logging

from tfmgpu import checks
from tfmgpu._lazy import LazyModule

tf = LazyModule("tensorflow")



def _tf_config_resolver():
  raw = os.environ.get("TF_CONFIG")
  if raw is not None and not raw.strip():
    # Empty means no cluster (`tfmgpu.cluster`); TF's resolver would fail
    # to parse it ("Expecting value: line 1 column 1").
    logging.info("TF_CONFIG is set but empty: no cluster; unsetting it.")
    del os.environ["TF_CONFIG"]
  elif raw:
    validate_tf_config(raw)
  return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def _slurm_resolver():
  if "SLURM_JOB_ID" not in os.environ:
    raise ValueError(
        "cluster_resolver='slurm' but no SLURM job is visible (SLURM_JOB_ID is "
        "unset). Run under srun/sbatch, or use cluster_resolver='tf_config'.")
  if tf.config.list_physical_devices("GPU"):
    return tf.distribute.cluster_resolver.SlurmClusterResolver()
  return _cpu_slurm_resolver()


def _cpu_slurm_resolver():
  """`SlurmClusterResolver` for nodes without GPUs.

  TF's resolver gives each task its own GPUs, so on a node without any it
  resolves no task at all (or fails looking for nvidia-smi). Here each task
  gets one placeholder GPU slot that is never used: CUDA_VISIBLE_DEVICES is
  left alone and `num_accelerators()` reports none, so each task trains on
  its CPU.
  """

  class CpuSlurmClusterResolver(
      tf.distribute.cluster_resolver.SlurmClusterResolver):

    def num_accelerators(self, task_type=None, task_id=None,
                         config_proto=None):
      del task_type, task_id, config_proto
      return {}

  tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS")
              or os.environ.get("SLURM_NTASKS") or 1)
  return CpuSlurmClusterResolver(gpus_per_node=tasks, gpus_per_task=1,
                                 auto_set_gpu=False)


CLUSTER_RESOLVERS: dict[str, Callable[[], Any]] = {
    "tf_config": _tf_config_resolver,
    "slurm": _slurm_resolver,
}


def _check_job_addresses(job: str, addresses: Any) -> None:
  """A job's addresses must be a list of "host:port" strings.

  Raises:
    ValueError: a string (which would read as one address per character),
      or anything else that is not a list of strings.
  """
  if isinstance(addresses, str):
    raise ValueError(
        f"TF_CONFIG's cluster gives job {job!r} the string {addresses!r}, "
        f"not a list of addresses: write \"{job}\": [{json.dumps(addresses)}]"
        " (one \"host:port\" per task).")
  values = (list(addresses.values()) if isinstance(addresses, dict)
            else addresses)
  if not isinstance(values, list) or not all(isinstance(a, str)
                                             for a in values):
    raise ValueError(
        f"TF_CONFIG's cluster gives job {job!r} {addresses!r}: it must be a "
        f"list of \"host:port\" strings, e.g. \"{job}\": "
        "[\"10.0.0.1:2222\", \"10.0.0.2:2222\"].")


def validate_tf_config(raw: str) -> dict[str, Any]:
  """Parses and checks a `TF_CONFIG` value.

  Raises:
    ValueError: malformed JSON, missing `cluster`/`task`, or a task index
      outside its job.
  """
  try:
    cfg = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}") from e
  if not isinstance(cfg, dict) or not isinstance(cfg.get("cluster"), dict):
    raise ValueError(
        f"TF_CONFIG needs a 'cluster' object mapping job names to address "
        f"lists; got {raw[:200]!r}.")
  for job, addresses in cfg["cluster"].items():
    _check_job_addresses(job, addresses)
  task = cfg.get("task") or {}
  job, index = task.get("type"), task.get("index", 0)
  if job is not None:
    if job not in cfg["cluster"]:
      raise ValueError(f"TF_CONFIG task type {job!r} is not a job of the "
                       f"cluster ({', '.join(cfg['cluster'])}).")
    n = len(cfg["cluster"][job])
    if not isinstance(index, int) or isinstance(index, bool):
      raise ValueError(f"TF_CONFIG task index {index!r} must be an integer "
                       f"(JSON {{\"index\": 0}}, not a string), one of "
                       f"0..{n - 1} for job {job!r}.")
    if not 0 <= index < n:
      raise ValueError(f"TF_CONFIG task index {index!r} is out of range: job "
                       f"{job!r} has {n} task(s) (indices 0..{n - 1}).")
  return cfg


def make_resolver(cluster_resolver: str | Any):
  """The resolver named `cluster_resolver` (or a resolver object, as is)."""
  if not isinstance(cluster_resolver, str):
    return cluster_resolver  # A ClusterResolver object passed through.
  checks.check_choice("cluster_resolver", cluster_resolver, CLUSTER_RESOLVERS)
  return CLUSTER_RESOLVERS[cluster_resolver]()
