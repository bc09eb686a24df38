"""What a run of the benchmark suite measures: `SuiteOptions`."""

from __future__ import annotations

import dataclasses

# The sections a run makes unless `--sections` says otherwise, in order.
DEFAULT_SECTIONS = ("training", "ceiling", "optimisations", "compression",
                    "inference", "latency", "tf_data", "language_model",
                    "checkpoints", "projection")
# The sections made only when `--sections` names them.
ON_REQUEST_SECTIONS = ("hybrid", "generate", "zero")
# What `--quick` runs unless `--sections` is given: the sections whose
# figures have targets, each cut down (`SuiteOptions.quick`).
QUICK_SECTIONS = ("training", "ceiling", "inference", "tf_data",
                  "language_model")
# The models `--quick` trains unless `--models` is given: the convnet, whose
# figures sit nearest their targets (the mlp's, 1.14-1.79 in quick runs
# against 1.0-1.2, are left to the full run).
QUICK_MODELS = ("convnet",)
# The sections that measure in a child process (every core per op).
CHILD_SECTIONS = ("ceiling", "language_model")


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
  """What the suite runs.

  Attributes:
    models: registered model names to train.
    replicas: replica counts for `mirrored` (needs that many devices).
    steps: timed steps per run; quick mode uses fewer.
    global_batch_size: examples per step.
    steps_per_execution: for tfmgpu and Keras fit alike (matched).
    rounds: interleaved repetitions per path (best kept), each building
      its path afresh.
    training_rounds: interleaved rounds of the training table, whose paths
      are built once (a round costs only its steps, so more are kept).
    output_dir: CSV and PNG go here.
    quick: fewer steps, rounds and paths (the autotune only read from its
      cache, the training table without its floors, the ceiling of the
      convnet at the suite's batch, the language model on one device and
      data parallelism), for a run of about 2-3.5 minutes on 2 quiet cores.
    autotune: before the training table, measure tfmgpu's options for each
      model and replica count (`tfmgpu.training.autotune`, cached) and train
      the `tfmgpu` path with the choice; `False`: tfmgpu's defaults.
  """
  models: tuple[str, ...] = ("convnet", "mlp")
  replicas: tuple[int, ...] = (1, 2, 4)
  steps: int = 120
  global_batch_size: int = 64
  steps_per_execution: int = 10
  rounds: int = 2
  training_rounds: int = 2
  output_dir: str = "bench_results"
  quick: bool = False
  autotune: bool = True
