"""The benchmark suite behind `python -m tfmgpu.bench`: options and one run.

Everything is measured side by side in one process (paths interleaved) and
reported as ratios; projections for multi-GPU hosts are labelled as such.
`run_suite` runs the chosen `sections` (each prints its table into a
`report.Report`), then writes `results.csv` and the plots.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from absl import logging

from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
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
  arrays = data_lib.load_dataset("digits")
  for name in sections:
    logging.info("bench section %s", name)
    sections_lib.SECTIONS[name](report, opts, arrays)
  os.makedirs(opts.output_dir, exist_ok=True)
  csv_path = report.write_csv(os.path.join(opts.output_dir, "results.csv"))
  written = plots.write_plots(report, opts)
  report.say(f"\nWrote {csv_path}" + "".join(f", {p}" for p in written))
  report.say(f"Suite took {time.perf_counter() - start:.0f} s.")
  return report
