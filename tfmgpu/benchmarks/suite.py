"""The benchmark suite behind `python -m tfmgpu.bench`: options and one run.

Everything is measured side by side in one process (paths interleaved) and
reported as ratios; projections for multi-GPU hosts are labelled as such.
`run_suite` runs the chosen `sections` (each prints its table into a
`report.Report`), then writes `results.csv` and the plots, says how long
each section took, and ends with one verdict line per target.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from absl import logging

from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
from tfmgpu.benchmarks import child
from tfmgpu.benchmarks import plots
from tfmgpu.benchmarks import report as report_lib
from tfmgpu.benchmarks import sections as sections_lib
from tfmgpu.benchmarks.options import SuiteOptions


def run_suite(opts: SuiteOptions, *,
              sections: Sequence[str] = tuple(sections_lib.SECTIONS),
              out: Any = print) -> report_lib.Report:
  """Runs the chosen sections and writes `results.csv` (+ plots)."""
  unknown = [s for s in sections if s not in sections_lib.SECTIONS]
  if unknown:
    raise ValueError(f"sections {unknown} are unknown. Choose from "
                     f"{', '.join(sections_lib.SECTIONS)}.")
  need = max(opts.replicas)
  have = len(devices_lib.accelerator_devices())
  if need > have:
    raise ValueError(f"replicas={list(opts.replicas)} needs {need} devices but "
                     f"{have} exist. Use --virtual_devices={need}.")
  start = time.perf_counter()
  machine = report_lib.machine_description()
  report = report_lib.Report(out, machine=machine)
  report.say(f"Machine: {machine}")
  report.say(f"Load average {os.getloadavg()[0]:.2f} at the start (other "
             "work on the cores makes every timing noisier); "
             f"{'--quick' if opts.quick else 'a full run'}: expect about "
             f"{EXPECTED_MINUTES[opts.quick]} on a quiet 2-core machine"
             + _slower_kernels() + ".")
  arrays = data_lib.load_dataset("digits")
  child.wait_ready()  # Its start-up shares no core with what is timed.
  took = {}
  for name in sections:
    logging.info("bench section %s", name)
    begin, cpu = time.perf_counter(), _cpu_seconds()
    sections_lib.SECTIONS[name](report, opts, arrays)
    took[name] = (time.perf_counter() - begin, _cpu_seconds() - cpu)
  os.makedirs(opts.output_dir, exist_ok=True)
  csv_path = report.write_csv(os.path.join(opts.output_dir, "results.csv"))
  written = plots.write_plots(report, opts)
  report.say(f"\nWrote {csv_path}" + "".join(f", {p}" for p in written))
  seconds = time.perf_counter() - start
  # CPU seconds (every thread of this process) say what the run costs on
  # cores nobody else uses; wall seconds on a loaded machine do not.
  report.say(f"Suite took {seconds:.0f} s wall, {_cpu_seconds():.0f} s "
             "CPU (this process and its children); by section, wall / CPU s: " + ", ".join(
                 f"{name} {wall:.0f} / {cpu:.0f}"
                 for name, (wall, cpu) in took.items())
             + f"; load average {os.getloadavg()[0]:.2f} at the end.")
  if opts.quick:
    report.figure("bench --quick wall time, s", seconds, target=
                  report_lib.Target(QUICK_SECONDS, at_least=False,
                                    why="on 2 quiet cores"))
  report.say_verdicts()
  return report


def _slower_kernels() -> str:
  """What the expected time leaves out on a CPU host where TensorFlow left
  its oneDNN kernels off (the times above were measured with them on)."""
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  if _compat.onednn_enabled() is not False or devices_lib.list_devices("GPU"):
    return ""
  return (" with TensorFlow's oneDNN kernels; they are off here, which made "
          "--quick take 8 minutes on a 2-core AVX2 EPYC (docs/benchmarks.md)")


def _cpu_seconds() -> float:
  """CPU seconds (user + system, every thread) of this process, of the
  child processes it waited for, and of the shared child at its last
  answer (its start-up counted with its first call)."""
  times = os.times()
  return (times.user + times.system + times.children_user
          + times.children_system + child.shared_cpu_seconds())


# What the suite takes on a quiet 2-core machine (the last measured runs;
# `docs/benchmarks.md`), by `SuiteOptions.quick`. --quick: 138 s (174 CPU
# seconds, much of it one thread at a time: building and tracing) on a
# quiet 2-core AMD EPYC, 2026-12-07. A full run whose autotune measures (its
# first run on a machine, or after a change of the code that trains: 47
# minutes on the Xeon, 56 on the EPYC) takes longer.
EXPECTED_MINUTES = {True: "2.5 minutes",
                    False: "15 minutes with the autotune read from its "
                    "cache, 45-60 when it measures (first run, new code)"}
# The quick run's target (issue 30), seconds on 2 quiet cores.
QUICK_SECONDS = 150
