r"""Benchmarks pipeline overlap: one K-stage split with M micro-batches vs 1.

TensorFlow runs each op on one thread (`--intra_op=1`) and up to
`--inter_op` ops at once, with one logical CPU per stage on a 2-core machine:
two stages go faster together only if their ops really run at the same time.
(TF's oneDNN kernels hand an op's work to the intra-op pool and wait, so with
one intra-op thread, ops of different stages would queue on that one thread;
the script sets TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD=1, unless set, so each
op runs on its own inter-op thread.) For M=1 and M=--micro_batches it prints:

* the median step time (interleaved runs, same process) and the speed-up;
* each stage's forward/backward time on one micro-batch, measured alone, and
  its busy time per step (M times their sum);
* the measured bubble `1 - sum(busy) / (K * step)` next to the theoretical
  `(K - 1) / (M + K - 1)` and the simulator's;
* the simulator's predicted step time (from the measured stage times, plus
  the measured optimizer update) against the measured one;
* the simulated timelines as ASCII Gantt charts (and a PNG with --png).

  python scripts/bench_pipeline.py                      # K=2, M=4 vs 1
  python scripts/bench_pipeline.py --micro_batches=8 --schedule=1f1b

Unlike a GPU, a CPU stage is not one in-order stream: with 2 inter-op
threads a stage alone already runs each layer's two backward matmuls (weight
and input gradients) at once, so M=1 is not fully serial and the gain from
pipelining is smaller than the bubble alone suggests. Micro-batches must stay
large enough for their matmuls to be as efficient as the whole batch's (see
docs/benchmarks.md for the sizes measured); hence the default batch of 1024.

This script sets up TensorFlow's threads and the logical devices and reads
the flags; `tfmgpu.benchmarks.pipeline_overlap` measures and prints.

On a shared 2-core machine, other processes steal cycles: check `uptime` and
run it when the machine is quiet.
"""

import os
import pathlib
import sys

from absl import app
from absl import flags

# Run from a checkout: make `tfmgpu` importable without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_WIDTH = flags.DEFINE_integer("width", 1024, "Units per hidden layer (and "
                              "input features).", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 8, "Hidden layers.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 1024, "Examples per step.",
                              lower_bound=1)
_STAGES = flags.DEFINE_integer("num_stages", 2, "Pipeline stages (K).",
                               lower_bound=1)
_MICRO = flags.DEFINE_integer("micro_batches", 4, "Micro-batches (M), "
                              "compared with M=1.", lower_bound=1)
_SCHEDULE = flags.DEFINE_enum("schedule", "gpipe", ["gpipe", "1f1b"],
                              "Pipeline schedule.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per setting.",
                              lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps first.",
                               lower_bound=0)
_INTRA = flags.DEFINE_integer("intra_op", 1, "Threads per op.", lower_bound=1)
_INTER = flags.DEFINE_integer("inter_op", 2, "Ops run at once (>= 2 to let "
                              "stages overlap).", lower_bound=1)
_PNG = flags.DEFINE_string("png", None, "Also draw the simulated timelines "
                           "to this PNG prefix (needs matplotlib).")


def _configure():
  """Threading and logical devices: before TensorFlow initialises."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # TF's oneDNN kernels (the default on x86) hand each op's work to the
  # intra-op pool and wait; with one intra-op thread, ops on different
  # logical CPUs then queue on that one thread and never overlap. Running the
  # work on the calling (inter-op) thread instead lets them overlap.
  os.environ.setdefault("TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD", "1")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfmgpu  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(_INTRA.value)
  tf.config.threading.set_inter_op_parallelism_threads(_INTER.value)
  tfmgpu.configure_devices(logical_cpus=_STAGES.value)
  return tfmgpu.list_devices("CPU")[:_STAGES.value]


def main(argv):
  del argv
  devices = _configure()
  from tfmgpu.benchmarks import pipeline_overlap  # pylint: disable=g-import-not-at-top

  K, M, batch = _STAGES.value, _MICRO.value, _BATCH.value
  if batch % M:
    raise app.UsageError(f"--batch_size={batch} is not divisible by "
                         f"--micro_batches={M}; use a multiple of {M}.")
  run = pipeline_overlap.benchmark_deep_mlp(
      devices, width=_WIDTH.value, depth=_DEPTH.value, batch_size=batch,
      micro_batches=M, schedule=_SCHEDULE.value, steps=_STEPS.value,
      warmup=_WARMUP.value)
  print(f"\nPipeline benchmark: deep_mlp width={_WIDTH.value} "
        f"depth={_DEPTH.value}, batch {batch}, K={K} stages on "
        f"{', '.join(devices)}, schedule={_SCHEDULE.value}, "
        f"intra_op={_INTRA.value}, inter_op={_INTER.value}, "
        "TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD="
        f"{os.environ['TF_ONEDNN_THREADPOOL_USE_CALLER_THREAD']}, "
        f"{_STEPS.value} interleaved steps "
        f"(median), load average {os.getloadavg()[0]:.2f}")
  pipeline_overlap.print_report(run, png_prefix=_PNG.value)


if __name__ == "__main__":
  app.run(main)
