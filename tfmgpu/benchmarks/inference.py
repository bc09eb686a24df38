"""Side-by-side inference timing: `tfmgpu.predict` against Keras `predict`.

Both paths serve the same model (same weights) under the same strategy and
batch, in one process; each is warmed up once (tracing) and its best full
pass over the inputs is kept.
"""

from __future__ import annotations

import time

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
  predictor.predict(x)
  best = min((_seconds(lambda: predictor.predict(x)) for _ in range(rounds)),
             default=float("inf"))
  return training.Timing("tfmgpu", best * 1e3, len(x))
