"""One set of collective keys for every one-host `MirroredStrategy` of a
process, so that a second strategy does not replay the first one's keys.

TF 2.21 gives each `tf.distribute.MirroredStrategy` its own counters, all
starting at group key 1 and instance key 100, while the runtime remembers
every (group, instance) it has resolved for the life of the process. So
after one strategy has all-reduced, a second one over the same devices whose
first all-reduce has another shape fails ("Shape mismatch in the collective
instance 100", tensorflow/tensorflow#62790: a notebook or a sweep training
one model after another), and one over another device count fails
("joining a group with size 2, but that group has size 4"). TF's own
advice is to restart the program.

`share(strategy)` points a strategy's collective all-reduces at this
module's keys instead: one group key per device set, instance keys never
reused within the process. tfmgpu calls it for every strategy it builds or
is given (`get_strategy`, `Trainer`, `predict`), before tracing anything.
Strategies spanning workers keep TF's keys, which every worker must derive
alike.
"""

from __future__ import annotations

import threading
from typing import Any

import tensorflow as tf

from tfmgpu import _compat

# Far above the group keys TF hands out itself (from 1, one per device set),
# so strategies tfmgpu never saw keep theirs.
GROUP_KEY_START = 1 << 20

_lock = threading.Lock()
_keys = None


def process_keys() -> Any:
  """The process's shared `CollectiveKeys` (created on first use)."""
  global _keys
  with _lock:
    if _keys is None:
      _keys = _compat.collective_keys(GROUP_KEY_START)
    return _keys


def share(strategy: tf.distribute.Strategy) -> bool:
  """Gives a one-host `MirroredStrategy`'s collective all-reduces the
  process's shared keys; other strategies are left as they are.

  Idempotent. Call it before the strategy traces a function: a function
  traced before keeps its group key (its instance keys are shared anyway).

  Returns:
    Whether any of the strategy's all-reduces now uses the shared keys.
  """
  if (not isinstance(strategy, tf.distribute.MirroredStrategy)
      or _compat.in_multi_worker_mode(strategy)):
    return False
  return _compat.rekey_collectives(strategy, process_keys()) > 0
