"""The cost model's machine figures, measured on this host: `calibrate`.

The cost model (`tfmgpu.parallel.accounting`, `timeline.simulate`) assumes
nominal figures per device kind (`links.DEVICE_FLOPS`, ...). A short probe
(a few seconds, run once per host, devices and code, then read from
`calibration.json` in the tfmgpu cache directory as the autotune's choices
are) measures instead, on the devices a run uses:

* `flops_per_s`: one device's training rate, a chain of dense layers'
  forward and backward (1024 x 256 rows by 256 x 256 weights) run alone;
* `task_overhead_s`: what each forward or backward of a stage costs beyond
  its math in a pipelined step, from a tiny two-stage `PipelinedModel`
  timed at M=1 and M=8 micro-batches: `(t8 - t1) / (7 * 2 * 2)` tasks;
* `send_overhead_s` and `link_bytes_per_s`: a tensor made on one device
  and read on the next, less the same call on one device, at 4 KB and 4 MB;
* `concurrency`: how many devices' worth of compute the devices get when
  they all compute at once, `n * t(one chain alone) / t(one chain on each)`
  (`n`: each has its own cores; 1.0: logical devices of one CPU taking
  turns). `timeline.simulate(concurrency=)` shares it among the tasks
  running at once.

Nothing is chosen by CPU name: the name is part of the cache key only.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from absl import logging

from tfmgpu.parallel import accounting

CACHE_FILE = "calibration.json"
_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The figures `calibrate` measured (see the module docstring).

  Attributes:
    devices: the devices measured (the first two for sends and tasks).
    flops_per_s: one device's training FLOP/s, alone.
    task_overhead_s: fixed time of each stage forward or backward.
    send_overhead_s: the sender's time per cross-device send.
    link_bytes_per_s: bytes/s of a large send between two devices.
    concurrency: devices' worth of compute the devices share.
    source: `"measured"` or `"cached"`.
  """
  devices: tuple[str, ...]
  flops_per_s: float
  task_overhead_s: float
  send_overhead_s: float
  link_bytes_per_s: float
  concurrency: float
  source: str = "measured"

  def hardware(self, num_devices: int | None = None, *,
               memory_bytes: int = 16 * 10**9) -> accounting.Hardware:
    """The `accounting.Hardware` of these devices as measured."""
    kind = "GPU" if any("GPU" in d.upper() for d in self.devices) else "CPU"
    return accounting.Hardware(
        num_devices or len(self.devices), kind, memory_bytes,
        self.flops_per_s, self.link_bytes_per_s, link="measured",
        task_overhead_s=self.task_overhead_s,
        send_overhead_s=self.send_overhead_s,
        concurrency=self.concurrency)

  def words(self) -> str:
    """`38.2 GFLOP/s a device, 0.41 ms a task, ...` for summaries."""
    return (f"{self.flops_per_s / 1e9:.1f} GFLOP/s a device, "
            f"{self.task_overhead_s * 1e3:.2f} ms a stage task, "
            f"{self.send_overhead_s * 1e3:.2f} ms a send, the "
            f"{len(self.devices)} devices compute at once "
            f"x{self.concurrency:.2f}; {self.source} on this host")


def _seconds(fn, *args) -> float:
  start = time.perf_counter()
  fn(*args).numpy()
  return time.perf_counter() - start


def _best(fns: Sequence[Any], rounds: int) -> list[float]:
  """Each function's best time over `rounds` interleaved rounds."""
  for fn in fns:
    fn().numpy()  # Traces.
  times = [[_seconds(fn) for fn in fns] for _ in range(rounds)]
  return [min(t[i] for t in times) for i in range(len(fns))]


def measure_concurrency(devices: Sequence[str], *, rounds: int = 9,
                        depth: int = 40) -> float:
  """How many of `devices` compute at once: one chain of `depth` matmuls
  (1024 x 128) on `devices[0]` alone against one chain on each device in
  the same call, `len(devices) * t(one) / t(all)` of the best rounds
  (interleaved). `len(devices)`: full overlap; 1.0: they take turns."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = tf.random.normal([1024, 128])
  w = tf.random.normal([128, 128]) * 0.05

  def chain(device):
    with tf.device(device):
      a = x
      for _ in range(depth):
        a = tf.tanh(tf.matmul(a, w))
      return tf.reduce_sum(a)

  one, every = _best([tf.function(lambda: chain(devices[0])),
                      tf.function(lambda: tf.add_n(
                          [chain(d) for d in devices]))], rounds)
  return len(devices) * one / every


def measure_send_s(source: str, target: str, nbytes: int, *,
                   repeats: int = 30) -> float:
  """Seconds one tensor of `nbytes` costs to send from device `source` to
  `target`: a traced call that makes it on `source` and reads it on
  `target`, less the same call on `source` alone (median of `repeats`
  interleaved pairs, at least 0)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  value = tf.zeros([max(nbytes // 4, 1)])

  def make(where):
    @tf.function
    def call(v):
      with tf.device(source):
        a = v + 1.0
      with tf.device(where):
        return tf.reduce_sum(a)
    return call

  cross, local = make(target), make(source)
  cross(value).numpy()
  local(value).numpy()
  gaps = [_seconds(cross, value) - _seconds(local, value)
          for _ in range(repeats)]
  return max(statistics.median(gaps), 0.0)


def measure_flops_per_s(device: str, *, rows: int = 1024, width: int = 256,
                        depth: int = 8, rounds: int = 5) -> float:
  """One device's training FLOP/s: `depth` dense tanh layers' forward and
  backward (3 x 2 x rows x width^2 each), best of `rounds`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.device(device):
    x = tf.random.normal([rows, width])
    ws = [tf.Variable(tf.random.normal([width, width]) * 0.05)
          for _ in range(depth)]

  @tf.function
  def train():
    with tf.device(device), tf.GradientTape() as tape:
      a = x
      for w in ws:
        a = tf.tanh(tf.matmul(a, w))
      loss = tf.reduce_sum(a)
    return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, ws)])

  best, = _best([train], rounds)
  return 3 * 2 * rows * width * width * depth / best


def measure_task_overhead_s(devices: Sequence[str], *, rounds: int = 5
                            ) -> float:
  """What each stage forward or backward costs beyond its math: a tiny
  two-stage `PipelinedModel` (4 x 8 dense layers, batch 64) at M=8 against
  M=1, `(t8 - t1) / (7 * 4)`, at least 0."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((8,))] + [
      keras.layers.Dense(8, activation="tanh") for _ in range(4)])
  plan = partition.plan_stages(model, 2, devices=list(devices[:2]))
  x, y = tf.zeros([64, 8]), tf.zeros([64, 8])
  loss_fn = lambda t, p: tf.reduce_sum(tf.square(t - p))

  def step_of(m):
    pipe = pipeline.PipelinedModel(model, plan, micro_batches=m)
    return tf.function(lambda: tf.add_n(
        [tf.reduce_sum(g) for g in
         pipe.compute_loss_and_gradients(x, y, loss_fn)[2]]))

  one, many = _best([step_of(1), step_of(8)], rounds)
  return max(many - one, 0.0) / (7 * 2 * 2)


def measure(devices: Sequence[str]) -> Calibration:
  """Runs the probe on `devices` (see the module docstring)."""
  devices = tuple(devices)
  pair = devices[:2] if len(devices) > 1 else devices * 2
  small = measure_send_s(pair[0], pair[1], 4096)
  large = measure_send_s(pair[0], pair[1], 4 << 20)
  return Calibration(
      devices=devices, flops_per_s=measure_flops_per_s(devices[0]),
      task_overhead_s=(measure_task_overhead_s(pair)
                       if len(devices) > 1 else 0.0),
      send_overhead_s=small,
      link_bytes_per_s=(4 << 20) / max(large - small, 1e-6),
      concurrency=(measure_concurrency(devices, rounds=5, depth=20)
                   if len(devices) > 1 else 1.0))


def _key(devices: Sequence[str]) -> str:
  from tfmgpu.training import autotune  # pylint: disable=g-import-not-at-top
  return json.dumps({"format": _FORMAT, "devices": list(devices),
                     **autotune.machine_key()}, sort_keys=True, default=str)


def calibrate(devices: Sequence[str], *, use_cache: bool = True
              ) -> Calibration:
  """The `Calibration` of `devices`: read from the cache of this host,
  devices and code, else measured (a few seconds) and cached."""
  import os  # pylint: disable=g-import-not-at-top
  from tfmgpu import data as data_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu import files  # pylint: disable=g-import-not-at-top
  path, key = os.path.join(data_lib.cache_dir(), CACHE_FILE), _key(devices)
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    entries = {}
  if use_cache and isinstance(entries.get(key), dict):
    found = dict(entries[key], devices=tuple(entries[key]["devices"]))
    return Calibration(**{**found, "source": "cached"})
  found = measure(devices)
  entries = entries if isinstance(entries, dict) else {}
  entries[key] = dataclasses.asdict(found)
  try:
    files.write_atomically(path, lambda f: f.write(
        json.dumps(entries, indent=1).encode("utf-8")))
  except OSError as e:
    logging.info("Not caching the calibration in %s (%s).", path, e)
  return found
