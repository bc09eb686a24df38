"""The summary rows of a parameter_server run name its workers and ps tasks."""

import types

from tfmgpu.strategies import registry


class _Resolver:

  def __init__(self, spec):
    self.spec = spec

  def cluster_spec(self):
    return types.SimpleNamespace(as_dict=lambda: self.spec)


def _placement(spec):
  strategy = types.SimpleNamespace(cluster_resolver=_Resolver(spec),
                                   num_replicas_in_sync=1)
  return registry.Placement(strategy, ["/device:CPU:0"], model=None)


def test_rows_count_the_workers_and_the_ps_tasks():
  distribution = registry.lookup("parameter_server")
  rows = distribution.describe(_placement({
      "chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}))
  assert rows == [("workers", "2 on h:2, h:3"),
                  ("parameter servers", "1 on h:4")]


def test_without_a_cluster_spec_it_falls_back_to_the_replicas():
  distribution = registry.lookup("parameter_server")
  assert distribution.describe(_placement({})) == [
      ("replicas", "1 on /device:CPU:0")]


def test_a_real_strategys_resolver_is_found_where_tf_keeps_it():
  """Issue 29 item 16: a 2-worker run's summary said "replicas 1 on
  /device:CPU:0". TF's `Strategy.cluster_resolver` property (used here as
  is) reads `extended._cluster_resolver`, which ParameterServerStrategy never
  sets; the strategy keeps the resolver in `_cluster_resolver`."""
  import tensorflow as tf

  class _LikeParameterServerStrategy:
    cluster_resolver = tf.distribute.Strategy.cluster_resolver
    num_replicas_in_sync = 1

    def __init__(self, spec):
      self._cluster_resolver = _Resolver(spec)
      self.extended = types.SimpleNamespace()

  strategy = _LikeParameterServerStrategy(
      {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]})
  assert strategy.cluster_resolver is None
  placement = registry.Placement(strategy, ["/device:CPU:0"], model=None)
  assert registry.lookup("parameter_server").describe(placement) == [
      ("workers", "2 on h:2, h:3"), ("parameter servers", "1 on h:4")]
