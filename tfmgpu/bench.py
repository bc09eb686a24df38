r"""Benchmark suite: `python -m tfmgpu.bench [--quick]`.

Trains and serves the same models, data and strategies through tfmgpu,
Keras `fit`/`predict`, TF's tutorial loop and a bare single-device loop, in
one process, and prints ratios, a compute-ceiling check, optimisations
on/off, and a labelled projection for multi-GPU hosts. Writes
`<output_dir>/results.csv` and `throughput.png`.
"""

from __future__ import annotations


from absl import app
from absl import flags

from tfmgpu import flags as flags_lib
from tfmgpu.flags import batch
from tfmgpu.flags import devices as device_flags
from tfmgpu.flags import execution

for _group in (device_flags, batch, execution):
  flags.adopt_module_key_flags(_group)  # `--help` lists them too.

_QUICK = flags.DEFINE_bool(
    "quick", False, "Fewer steps and rounds: the whole suite in about 2.5 "
    "minutes on a quiet 2-core machine, up to ~8 on a loaded one.")
_MODELS = flags.DEFINE_list("models", ["convnet", "mlp"], "Models to train.")
_REPLICAS = flags.DEFINE_list("replicas", ["1", "2", "4"],
                              "Replica counts for 'mirrored'.")
_STEPS = flags.DEFINE_integer(
    "steps", 120, "Timed steps per run (quick mode: 8 calls of "
    "--steps_per_execution). Per-step times on "
    "shared cores are noisy; more steps steady the medians.", lower_bound=10)
_SECTIONS = flags.DEFINE_list(
    "sections", ["training", "ceiling", "optimisations", "compression",
                 "inference", "projection"], "Which parts of the suite to run.")
_INTRA_OP_THREADS = flags.DEFINE_integer(
    "intra_op_threads", None, "Threads per op. Default: cores // devices when "
    "the CPU is split; 0: TensorFlow's own setting (all cores per op).",
    lower_bound=0)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "bench_results",
                                  "Where results.csv and plots go.")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  replicas = tuple(int(r) for r in _REPLICAS.value)
  flags_lib.quiet_tensorflow()
  from tfmgpu.benchmarks import suite as bench_suite  # pylint: disable=g-import-not-at-top
  from tfmgpu import devices  # pylint: disable=g-import-not-at-top
  devices.configure_virtual_devices(device_flags.VIRTUAL_DEVICES.value or max(replicas),
                                    intra_op_threads=_INTRA_OP_THREADS.value)
  quick = _QUICK.value
  options = bench_suite.SuiteOptions(
      models=tuple(_MODELS.value), replicas=replicas,
      steps=8 * execution.STEPS_PER_EXECUTION.value
      if quick else max(_STEPS.value, 8 * execution.STEPS_PER_EXECUTION.value),
      global_batch_size=batch.GLOBAL_BATCH_SIZE.value,
      steps_per_execution=execution.STEPS_PER_EXECUTION.value,
      rounds=2 if quick else 3, output_dir=_OUTPUT_DIR.value, quick=quick)
  bench_suite.run_suite(options, sections=_SECTIONS.value,
                        out=lambda s: print(s, flush=True))
  return 0


def run() -> None:
  """Console-script entry point (`tfmgpu-bench`)."""
  app.run(main)


if __name__ == "__main__":
  run()
