"""What a suite run records: one `Row` per timing, headline figures, CSV.

`Report` prints each line as the suite produces it (so a long run shows its
progress) and keeps the rows and figures for `results.csv` and the plots.
Every table header names the CPU that measured it; every row of the CSV
does too (`cpu`, and `machine`: `machine_description`). A ratio measured
over interleaved rounds is printed with its spread: `1.23 (1.18-1.30)` is
the ratio of the two paths' best rounds, then the lowest and highest ratio
of one round's pair (the best-rounds ratio always lies between them).
A figure may carry a `Target` (issue 30's table and the targets kept from
earlier rounds); `Report.verdicts` gives one line per target, held or
missed, with the spread, and the suite prints them at the end of every run.
`tfmgpu.benchmarks.compare` reads two such CSVs back.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import platform
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class Row:
  """One timed path: a line of `results.csv`.

  Attributes:
    rounds_ms: each interleaved round's ms per step, in round order
      (`ms_per_step` is the best of them).
  """
  section: str
  model: str
  replicas: int
  path: str
  ms_per_step: float
  examples_per_sec: float
  note: str = ""
  rounds_ms: Sequence[float] = ()


@dataclasses.dataclass(frozen=True)
class Target:
  """What a figure must reach: `value >= bound` (`at_least`) or `<= bound`.

  Attributes:
    bound: the threshold.
    at_least: `True`: at least `bound`; `False`: at most.
    why: where a computed bound comes from ("80% of the simulated gain").
  """
  bound: float
  at_least: bool = True
  why: str = ""

  def met(self, value: float) -> bool:
    return value >= self.bound if self.at_least else value <= self.bound

  def text(self) -> str:
    """`"target >= 1.2"`, with `why` in brackets."""
    op = ">=" if self.at_least else "<="
    bound = (f"{self.bound:.0f}" if abs(self.bound) >= 10
             else f"{self.bound:.2f}")
    return f"target {op} {bound}" + (f", {self.why}" if self.why else "")


@dataclasses.dataclass
class Figure:
  """A headline figure: a ratio or fraction, with its spread over rounds."""
  name: str
  value: float
  rule: str = ""
  low: float | None = None
  high: float | None = None
  target: Target | None = None

  def verdict(self) -> str:
    """One line: held or missed, the value with its spread, the target; a
    spread that crosses the target is named (the verdict is the best
    rounds' ratio)."""
    if self.target is None:
      raise ValueError(f"figure {self.name!r} has no target.")
    held = self.target.met(self.value)
    spread = (None if self.low is None or self.high is None
              else (self.low, self.high))
    note = ""
    if spread is not None:
      worst, best = spread if self.target.at_least else spread[::-1]
      if held and not self.target.met(worst):
        note = f"; one round's pair missed it ({worst:.2f})"
      elif not held and self.target.met(best):
        note = f"; one round's pair held it ({best:.2f})"
    return (f"  {'held' if held else 'MISSED':<6} {self.name:<52} "
            f"{with_spread(self.value, spread, digits=3):<20} "
            f"{self.target.text()}{note}")


# `results.csv`: a row's fields, then a figure's, then the machine's. A
# figure is a line with section "figure", its name as `path`.
CSV_COLUMNS = ("section", "model", "replicas", "path", "ms_per_step",
               "examples_per_sec", "note", "rounds_ms", "value", "low",
               "high", "cpu", "machine")


def round_ratios(numerator_ms: Sequence[float],
                 denominator_ms: Sequence[float]) -> tuple[float, float] | None:
  """The lowest and highest `numerator / denominator` of one round's pair.

  Returns:
    `(low, high)`, or `None` with fewer than two paired rounds.
  """
  pairs = [n / d for n, d in zip(numerator_ms, denominator_ms) if d]
  return (min(pairs), max(pairs)) if len(pairs) > 1 else None


def with_spread(value: float, spread: tuple[float, float] | None,
                digits: int = 2) -> str:
  """`"1.23 (1.18-1.30)"`, or `"1.23"` without a spread."""
  if spread is None:
    return f"{value:.{digits}f}"
  return f"{value:.{digits}f} ({spread[0]:.2f}-{spread[1]:.2f})"


class Report:
  """Collects rows and figures, prints tables as they come, writes the CSV.

  Args:
    out: prints one line.
    cpu: the CPU model named in every table header and CSV row. Defaults
      to `tfmgpu.training.autotune.cpu_model()`.
    machine: the whole machine line (`machine_description()`) for the CSV.
  """

  def __init__(self, out: Any = print, *, cpu: str | None = None,
               machine: str = ""):
    if cpu is None:
      from tfmgpu.training import autotune  # pylint: disable=g-import-not-at-top
      cpu = autotune.cpu_model()
    self.rows: list[Row] = []
    self.figures: dict[str, float] = {}
    self.figure_details: list[Figure] = []
    # What one section measured for a later one (e.g. "matmul_gflops").
    self.measured: dict[str, float] = {}
    self.cpu = cpu
    self.machine = machine
    self._out = out

  def add(self, row: Row) -> None:
    self.rows.append(row)

  def say(self, text: str = "") -> None:
    self._out(text)

  def header(self, title: str) -> None:
    """Prints a table's header line, naming the CPU that measures it."""
    self.say(f"\n== {title} [{self.cpu}] ==")

  def figure(self, name: str, value: float, rule: str = "",
             spread: tuple[float, float] | None = None,
             target: Target | None = None) -> None:
    """Records a headline figure (a ratio or fraction) and prints it.

    Args:
      name, value, rule: what it is, its value, and its meaning (defaults
        to the target's text).
      spread: `(low, high)` over the interleaved rounds (`round_ratios`).
      target: what it must reach; judged in `verdicts`.
    """
    if not rule and target is not None:
      rule = f"({target.text()})"
    self.figures[name] = value
    low, high = spread if spread is not None else (None, None)
    self.figure_details.append(Figure(name, value, rule, low, high, target))
    cell = with_spread(value, spread, digits=3)
    self.say(f"  {name:<52} {cell:<20} {rule}".rstrip())

  def verdicts(self) -> list[str]:
    """One line per figure with a target (`Figure.verdict`), in order."""
    return [f.verdict() for f in self.figure_details if f.target is not None]

  def say_verdicts(self) -> None:
    """Prints the verdicts under a header, with how many held."""
    lines = self.verdicts()
    if not lines:
      return
    missed = sum(line.lstrip().startswith("MISSED") for line in lines)
    self.header(f"Targets: {len(lines) - missed} of {len(lines)} held "
                "(verdict: the best rounds' figure; spread: one round's pair)")
    for line in lines:
      self.say(line)

  def write_csv(self, path: str) -> str:
    """Writes every row, then every figure, to `path` (`CSV_COLUMNS`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    machine = {"cpu": self.cpu, "machine": self.machine}
    with open(path, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, restval="")
      writer.writeheader()
      for r in self.rows:
        line = dataclasses.asdict(r)
        line["rounds_ms"] = ";".join(f"{ms:.4f}" for ms in r.rounds_ms)
        writer.writerow({**line, **machine})
      for fig in self.figure_details:
        writer.writerow({"section": "figure", "path": fig.name,
                         "value": fig.value, "note": fig.rule,
                         "low": "" if fig.low is None else fig.low,
                         "high": "" if fig.high is None else fig.high,
                         **machine})
    return path


def machine_description(cpu: str | None = None) -> str:
  """One line: CPU, cores, Python, TF and Keras versions, whether TF's
  oneDNN CPU kernels are on, logical devices and threads per op."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import autotune  # pylint: disable=g-import-not-at-top
  threads = tf.config.threading.get_intra_op_parallelism_threads()
  onednn = {True: "on", False: "off"}.get(_compat.onednn_enabled(), "?")
  return (f"{cpu or autotune.cpu_model()}; {os.cpu_count()} cores; Python "
          f"{platform.python_version()}; TensorFlow {tf.__version__}; Keras "
          f"{keras.__version__}; oneDNN {onednn}; "
          f"{len(devices_lib.accelerator_devices())} logical devices, "
          f"{threads or 'all'} thread(s) per op")
