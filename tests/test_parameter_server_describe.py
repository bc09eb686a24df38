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
