"""The suite's figures: training throughput, stage memory, a pipeline timeline.

Each plot goes to a PNG in the suite's output directory. Without matplotlib
the suite says so and writes none.
"""

from __future__ import annotations

import os

import numpy as np

from tfmgpu import devices as devices_lib
from tfmgpu import models as models_lib
from tfmgpu.benchmarks import report as report_lib
from tfmgpu.benchmarks.options import SuiteOptions
from tfmgpu.benchmarks import training
from tfmgpu.parallel import partition
from tfmgpu.parallel import timeline


def write_plots(report: report_lib.Report, opts: SuiteOptions
                ) -> list[str]:
  """Writes the plots to `opts.output_dir` (the throughput plot only when
  the training table ran); returns their paths."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    report.say("matplotlib is not installed (pip install '.[plots]'): no plots.")
    return []
  written = []
  if any(r.section == "training" for r in report.rows):
    written.append(_plot_throughput(plt, report, opts))
  return written + [_plot_stage_memory(plt, opts),
                    _plot_pipeline_timeline(opts)]


def _plot_throughput(plt, report: report_lib.Report,
                     opts: SuiteOptions) -> str:
  """Examples/s against replicas, one panel per model, one line per path."""
  fig, axes = plt.subplots(1, len(opts.models),
                           figsize=(5 * len(opts.models), 3.5))
  axes = np.atleast_1d(axes)
  for ax, model in zip(axes, opts.models):
    for path in training.PATHS:
      pts = sorted((r.replicas, r.examples_per_sec) for r in report.rows
                   if r.section == "training" and r.model == model
                   and r.path == path)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=path)
    ax.set_title(f"{model}: training throughput")
    ax.set_xlabel("replicas (logical CPU devices)")
    ax.set_ylabel("examples/s")
    ax.set_xticks(list(opts.replicas))
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  fig.tight_layout()
  out = os.path.join(opts.output_dir, "throughput.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def _plot_stage_memory(plt, opts: SuiteOptions) -> str:
  """Per-device training memory of a 4-stage plan of the demo deep MLP."""
  model = models_lib.build_model("deep_mlp", input_shape=(28, 28, 1),
                                 num_classes=10)
  stages = min(4, len(devices_lib.accelerator_devices()))
  plan = partition.plan_stages(model, stages, criterion="params")
  estimate = plan.memory_estimate(opts.global_batch_size)
  parts = ("weights", "gradients", "optimizer_slots", "activations")
  fig, ax = plt.subplots(figsize=(6, 3.5))
  bottom = np.zeros(len(estimate))
  names = [d.replace("/device:", "") for d in estimate]
  for part in parts:
    values = np.array([getattr(e, part) / 2**20 for e in estimate.values()])
    ax.bar(names, values, bottom=bottom, label=part)
    bottom += values
  ax.set_ylabel("MiB (estimate)")
  ax.set_title(f"deep_mlp in {stages} stages: memory per device "
               f"(batch {opts.global_batch_size}, Adam)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = os.path.join(opts.output_dir, "stage_memory.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def _plot_pipeline_timeline(opts: SuiteOptions) -> str:
  """The simulated GPipe timeline of 2 equal stages with 4 micro-batches."""
  out = os.path.join(opts.output_dir, "pipeline_timeline.png")
  timeline.simulate([1.0, 1.0], [2.0, 2.0], 4).plot(out)
  return out
