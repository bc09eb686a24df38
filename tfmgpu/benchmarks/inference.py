"""Side-by-side inference timing: `tfmgpu.predict` against Keras `predict`.

Both paths serve the same model (same weights) under the same strategy and
batch, in one process; each is warmed up once (tracing) and its best full
pass over the inputs is kept. `latency` times single requests (a few rows,
as online serving sends them): the median and 99th percentile per call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from tfmgpu import inference
from tfmgpu import models as models_lib
from tfmgpu.benchmarks import training


def _build(strategy, model_name: str, x: np.ndarray, seed: int):
  with strategy.scope():
    return models_lib.build_model(model_name, input_shape=x.shape[1:],
                                  num_classes=10, seed=seed)


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def compare_predict(strategy, model_name: str, x: np.ndarray, *,
                    batch_size: int = 1024, rounds: int = 3, seed: int = 0
                    ) -> dict[str, training.Timing]:
  """`tfmgpu.predict` vs Keras `model.predict`, same model, strategy, batch.

  Both models are built in `strategy`'s scope with the same weights; each
  path is warmed up once (tracing) and its best of `rounds` full passes over
  `x` is kept, interleaved (every pass's time in `rounds_ms`, per pass of
  all of `x`).
  """
  model = _build(strategy, model_name, x, seed)
  predictor = inference.Predictor(model, strategy=strategy,
                                  batch_size=batch_size)
  paths = {
      "tfmgpu": lambda: predictor.predict(x),
      "keras_predict": lambda: model.predict(x, batch_size=batch_size,
                                             verbose=0),
  }
  for run in paths.values():
    run()
  seconds: dict[str, list[float]] = {path: [] for path in paths}
  for _ in range(rounds):
    for path, run in paths.items():
      seconds[path].append(_seconds(run))
  return {k: training.best_round([training.Timing(k, s * 1e3, len(x))
                                  for s in v]) for k, v in seconds.items()}


def time_predictor(strategy, model_name: str, x: np.ndarray, *,
                   rounds: int = 2, seed: int = 0, **predictor_options
                   ) -> training.Timing:
  """Best-of-`rounds` time of `Predictor.predict` over all of `x`."""
  model = _build(strategy, model_name, x, seed)
  predictor = inference.Predictor(model, strategy=strategy,
                                  **predictor_options)
  return time_predictor_of(predictor, x, rounds=rounds)


def time_predictor_of(predictor: inference.Predictor, x: np.ndarray, *,
                      rounds: int = 2) -> training.Timing:
  """Best-of-`rounds` time of `predictor.predict` over all of `x` (after a
  warm-up pass)."""
  predictor.predict(x)
  best = min((_seconds(lambda: predictor.predict(x)) for _ in range(rounds)),
             default=float("inf"))
  return training.Timing("tfmgpu", best * 1e3, len(x))


@dataclasses.dataclass(frozen=True)
class Latency:
  """Per-request times of one path: median and 99th percentile, in ms."""
  path: str
  rows: int
  p50_ms: float
  p99_ms: float
  calls: int


def latency(path: str, call: Callable[[np.ndarray], Any], x: np.ndarray, *,
            rows: int, calls: int = 100) -> Latency:
  """Times `calls` requests of `rows` rows each (after one warm-up call).

  Each request takes the next `rows` rows of `x` (wrapping), so no path
  serves one cached input.
  """
  call(x[:rows])
  seconds = []
  for i in range(calls):
    start = (i * rows) % max(1, len(x) - rows)
    batch = x[start:start + rows]
    seconds.append(_seconds(lambda: call(batch)))
  p50, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 99])
  return Latency(path, rows, float(p50), float(p99), calls)
