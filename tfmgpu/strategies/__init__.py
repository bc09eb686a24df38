"""Strategies and placements by name: the registry and `get_strategy()`.

* `registry`: the `Distribution` base class, `register`, `lookup`; one
  registered object per name, the only list of names (the CLI's
  `--strategy` choices come from it).
* `data_parallel`: the data-parallel distributions, each building a genuine
  `tf.distribute.Strategy`; `options`: their options dataclasses.
* `replicas`: which devices replicate and how gradients are all-reduced.
* `resolvers`: cluster resolvers by name and the TF_CONFIG check.
* `collective_keys`: one set of collective keys for every one-host
  `MirroredStrategy` of a process (TF's own clash from the second one on).

Placements (model, pipeline, branch and tensor parallelism, `auto`)
register from `tfmgpu.placements`. Importing this package does not import TensorFlow.
"""

from __future__ import annotations

from typing import Any

from absl import logging

from tfmgpu.strategies.options import COMMUNICATION_CHOICES
from tfmgpu.strategies.options import SINGLE_REPLICA_CHOICES
from tfmgpu.strategies.registry import available_strategies
from tfmgpu.strategies.registry import Distribution
from tfmgpu.strategies.registry import Kind
from tfmgpu.strategies.registry import lookup
from tfmgpu.strategies.registry import Placement
from tfmgpu.strategies.registry import register
from tfmgpu.strategies.registry import registered
from tfmgpu.strategies.registry import RunFacts
from tfmgpu.strategies.registry import unregister
from tfmgpu.strategies.replicas import choose_cross_device_ops
from tfmgpu.strategies.replicas import CROSS_DEVICE_OPS_CHOICES
from tfmgpu.strategies.replicas import in_multi_worker_mode
from tfmgpu.strategies.replicas import make_cross_device_ops
from tfmgpu.strategies.replicas import replica_devices
from tfmgpu.strategies.replicas import short_device
from tfmgpu.strategies.resolvers import CLUSTER_RESOLVERS
from tfmgpu.strategies.resolvers import validate_tf_config

__all__ = [
    "available_strategies", "choose_cross_device_ops", "CLUSTER_RESOLVERS",
    "COMMUNICATION_CHOICES", "CROSS_DEVICE_OPS_CHOICES", "Distribution",
    "get_strategy", "in_multi_worker_mode", "Kind", "lookup",
    "make_cross_device_ops", "Placement", "register", "registered",
    "replica_devices", "RunFacts", "short_device", "SINGLE_REPLICA_CHOICES",
    "unregister", "validate_tf_config"]


def get_strategy(name: str = "default", **options: Any):
  """Builds the `tf.distribute.Strategy` registered under `name`.

  Never returns `None`: "no distribution" is the default strategy, so every
  caller can write `with strategy.scope():`. Names are case-insensitive.

  Args:
    name: a registered name; see `available_strategies()`.
    **options: options of that strategy (its `Options` dataclass), e.g.
      `devices`, `num_gpus`, `num_replicas`, `cross_device_ops`,
      `num_packs`, `single_replica` for `mirrored`; `communication`,
      `cluster_resolver` for `multi_worker_mirrored`; `variable_shards` for
      `parameter_server`; `parameter_device` for `central_storage`; `tpu`.

  Returns:
    A `tf.distribute.Strategy`; the default strategy for placements, whose
    stages place themselves (a warning says so, and how to use them).

  Raises:
    ValueError: unknown name or option, or a choice that cannot work here
      (NCCL without GPUs, more GPUs than exist, TPU without a TPU).
  """
  distribution = lookup(name)
  if distribution.kind is Kind.PLACEMENT and options:
    raise ValueError(
        f"strategy {name!r} is a placement of the model, not a "
        f"tf.distribute.Strategy; options {sorted(options)} belong to "
        "tfmgpu.parallel (e.g. tfmgpu.StagedModel / tfmgpu.plan_stages).")
  if options.get("zero_stage"):
    raise ValueError(
        f"zero_stage={options['zero_stage']!r}: a tf.distribute.Strategy "
        "keeps whole copies on every replica, so get_strategy cannot shard "
        "them. Wrap the built model instead: tfmgpu.parallel.ShardedModel("
        "model, devices, stage=...) trained by tfmgpu.Trainer, or run "
        "TrainConfig(strategy='mirrored', zero_stage=...).")
  strategy = distribution.make_strategy(distribution.options(**options))
  if distribution.kind is Kind.PLACEMENT:
    logging.warning("%s", placement_note(distribution))
  else:
    logging.info("Strategy %r: %d replica(s).", distribution.name,
                 strategy.num_replicas_in_sync)
  if distribution.keras_fit_caveat:
    logging.warning("get_strategy(%r): %s", distribution.name,
                    distribution.keras_fit_caveat)
  return strategy


def placement_note(distribution: Distribution) -> str:
  """What `get_strategy` says when asked for a placement: the model places
  itself, the strategy is the default one, and how to use the placement."""
  name = distribution.name
  own = (f", or place a model with {distribution.python_api}"
         if distribution.python_api else "")
  return (f"get_strategy({name!r}): {name!r} is a placement, which places "
          "the model itself on its devices; this is the default strategy "
          f"(1 replica). Use it with tfmgpu.TrainConfig(strategy={name!r}) "
          f"or python -m tfmgpu.train --strategy={name}{own}.")
