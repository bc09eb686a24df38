r"""Benchmark suite: `python -m tfmgpu.bench [--quick]`.

Trains and serves the same models, data and strategies through tfmgpu,
Keras `fit`/`predict`, TF's tutorial loop and a bare single-device loop, in
one process, and prints ratios (each with its spread over the interleaved
rounds), a compute-ceiling check, optimisations on/off, and a labelled
projection for multi-GPU hosts. tfmgpu's options are autotuned first
(cached; `--noautotune`: its defaults). The output is the tables alone;
`--logs` shows TensorFlow's and tfmgpu's log lines and warnings too. Writes
`<output_dir>/results.csv` (with the CPU model on every line) and plots.

  python -m tfmgpu.bench --compare A/results.csv B/results.csv

prints two saved runs (two machines, say) side by side; with one file, it
is compared with `<output_dir>/results.csv`.
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import os
import sys
import warnings

from absl import app
from absl import flags
from absl import logging

from tfmgpu import flags as flags_lib
from tfmgpu.benchmarks import child
from tfmgpu.benchmarks import options as bench_options
from tfmgpu.flags import autotune as autotune_flags
from tfmgpu.flags import batch
from tfmgpu.flags import devices as device_flags
from tfmgpu.flags import execution
from tfmgpu.flags import cli

for _group in (device_flags, batch, execution, autotune_flags):
  flags.adopt_module_key_flags(_group)  # `--help` lists them too.

_QUICK = flags.DEFINE_bool(
    "quick", False, "The sections with targets (" + ",".join(
        bench_options.QUICK_SECTIONS) + ", unless --sections says "
    "otherwise), the convnet alone unless --models is given, fewer steps, "
    "rounds and paths, the autotune only read from its cache: about 2.5 "
    "minutes on a quiet 2-core machine (the full "
    "suite: about 15, 45-60 when its autotune measures). Every run ends "
    "with a verdict line per target.")
_MODELS = flags.DEFINE_list("models", ["convnet", "mlp"],
                            "Models to train (--quick: convnet unless given).")
_REPLICAS = flags.DEFINE_list("replicas", ["1", "2", "4"],
                              "Replica counts for 'mirrored'.")
_STEPS = flags.DEFINE_integer(
    "steps", 120, "Timed steps per run (quick mode: 8 calls of "
    "--steps_per_execution). Per-step times on "
    "shared cores are noisy; more steps steady the medians.", lower_bound=10)
_SECTIONS = flags.DEFINE_list(
    "sections", list(bench_options.DEFAULT_SECTIONS),
    "Which parts of the suite to run (latency: p50/p99 of small requests per "
    "placement; tf_data: tfmgpu vs fit vs TF Orbit on a shuffled tf.data "
    "input; language_model: gpt tokens/s per layout vs Keras fit, and the "
    "pipeline's micro-batching gain vs the simulator; checkpoints: the cost "
    "of a save). Not run by default: hybrid (gpt tokens/s of data x "
    "pipeline x tensor layouts on 4 and, with --virtual_devices=8, 8 "
    "devices, against data parallelism, beside the cost model's projection "
    "for an 8-GPU host; on 2 cores ~1 minute with --quick, ~8 in full "
    "with --virtual_devices=8); generate (tfmgpu.generate tokens/s vs "
    "keras_hub's generate and a loop without a cache, one device, batch 1 "
    "and 32; needs keras-hub); zero (gpt step time and the fullest "
    "device's bytes of ZeRO stages 1 and 3 beside mirrored on up to 4 "
    "devices).")
_INTRA_OP_THREADS = flags.DEFINE_integer(
    "intra_op_threads", None, "Threads per op. Default: cores // devices when "
    "the CPU is split; 0: TensorFlow's own setting (all cores per op).",
    lower_bound=0)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "bench_results",
                                  "Where results.csv and plots go.")
_LOGS = flags.DEFINE_bool(
    "logs", False, "Also show TensorFlow's and tfmgpu's log lines and Python "
    "warnings (hidden by default: the output is the tables).")
_COMPARE = flags.DEFINE_list(
    "compare", [], "Measure nothing: print two saved runs side by side, "
    "`--compare A.csv B.csv` (or A.csv,B.csv); one file is compared with "
    "<output_dir>/results.csv.")


@contextlib.contextmanager
def _quiet_logs(show: bool):
  """Tables only: log lines and warnings hidden unless `show` (`--logs`);
  the process's logging and warning settings are restored afterwards (for
  a caller that runs `main` in its own process, e.g. a test or notebook)."""
  flags_lib.quiet_tensorflow(tensorflow_logs=show)
  verbosity = logging.get_verbosity()
  tf_logger = py_logging.getLogger("tensorflow")
  level = tf_logger.level
  with warnings.catch_warnings():
    if not show:
      logging.set_verbosity(logging.ERROR)  # tfmgpu's own INFO and warnings.
      tf_logger.setLevel(py_logging.ERROR)
      warnings.simplefilter("ignore")
    try:
      yield
    finally:
      logging.set_verbosity(verbosity)
      tf_logger.setLevel(level)


def _compare(files: list[str]) -> int:
  """`--compare`: prints two runs' CSVs side by side (TensorFlow unloaded)."""
  from tfmgpu.benchmarks import compare  # pylint: disable=g-import-not-at-top
  if len(files) == 1:
    files.append(os.path.join(_OUTPUT_DIR.value, "results.csv"))
  if len(files) != 2:
    raise app.UsageError(f"--compare takes one or two files; got {files}.")
  try:
    runs = [compare.read_run(f) for f in files]
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  compare.compare_runs(*runs, out=lambda s: print(s, flush=True))
  return 0


def main(argv: list[str]) -> int:
  if _COMPARE.value:
    return _compare(list(_COMPARE.value) + argv[1:])
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  sections, replicas = _sections(), _replicas()
  # The sections measured in a child process share one, whose TensorFlow
  # import runs beside this process's (before it: `_quiet_logs` loads it).
  with child.shared_process(start=bool(
      set(sections) & set(bench_options.CHILD_SECTIONS))):
    with _quiet_logs(_LOGS.value):
      return _run_suite(replicas, sections)


def _sections() -> list[str]:
  """The sections to run (`--quick`'s unless `--sections` is given).

  Raises:
    app.UsageError: `--sections` names one the suite does not have.
  """
  known = bench_options.DEFAULT_SECTIONS + bench_options.ON_REQUEST_SECTIONS
  unknown = [s for s in _SECTIONS.value if s not in known]
  if unknown:
    raise app.UsageError(f"--sections={','.join(_SECTIONS.value)}: "
                         f"{', '.join(unknown)} is not a section. Choose "
                         f"from {', '.join(known)}.")
  if _SECTIONS.present or not _QUICK.value:
    return list(_SECTIONS.value)
  return list(bench_options.QUICK_SECTIONS)


def _replicas() -> tuple[int, ...]:
  """`--replicas` as counts.

  Raises:
    app.UsageError: one is not a whole number of at least 1, or the
      largest is more than `--virtual_devices` makes.
  """
  try:
    replicas = tuple(int(r) for r in _REPLICAS.value)
  except ValueError:
    replicas = ()
  given = ",".join(_REPLICAS.value)
  if not replicas or min(replicas) < 1:
    raise app.UsageError(f"--replicas={given} must be whole numbers of at "
                         "least 1, e.g. --replicas=1,2,4.")
  made = device_flags.VIRTUAL_DEVICES.value
  if made and made < max(replicas):
    raise app.UsageError(
        f"--replicas={given} needs {max(replicas)} devices but "
        f"--virtual_devices={made} makes {made}. Give --virtual_devices="
        f"{max(replicas)} or more, or leave it out (the bench then makes "
        "as many as the largest --replicas).")
  return replicas


def _run_suite(replicas: tuple[int, ...], sections: list[str]) -> int:
  """Configures the devices and runs the chosen sections."""
  from tfmgpu.benchmarks import suite as bench_suite  # pylint: disable=g-import-not-at-top
  from tfmgpu import devices  # pylint: disable=g-import-not-at-top
  devices.configure_virtual_devices(device_flags.VIRTUAL_DEVICES.value or max(replicas),
                                    intra_op_threads=_INTRA_OP_THREADS.value)
  quick = _QUICK.value
  options = bench_suite.SuiteOptions(
      models=tuple(_MODELS.value) if _MODELS.present or not quick
      else bench_options.QUICK_MODELS, replicas=replicas,
      steps=8 * execution.STEPS_PER_EXECUTION.value
      if quick else max(_STEPS.value, 8 * execution.STEPS_PER_EXECUTION.value),
      global_batch_size=batch.GLOBAL_BATCH_SIZE.value,
      steps_per_execution=execution.STEPS_PER_EXECUTION.value,
      rounds=2 if quick else 3, training_rounds=5 if quick else 7,
      output_dir=_OUTPUT_DIR.value, quick=quick,
      autotune=autotune_flags.enabled(True))
  bench_suite.run_suite(options, sections=sections,
                        out=lambda s: print(s, flush=True))
  return 0


def run() -> None:
  """Console-script entry point (`tfmgpu-bench`)."""
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
