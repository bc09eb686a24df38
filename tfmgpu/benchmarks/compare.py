"""Two suite runs side by side: `python -m tfmgpu.bench --compare A.csv B.csv`.

Reads the `results.csv` each run wrote (`report.CSV_COLUMNS`) and prints
the headline figures of both, each with its spread over the rounds, then
every timing with B's time over A's. Files written before the CSV held
figures and the CPU (only the `Row` columns) are read too: their
`tfmgpu/keras_fit` and `tfmgpu.predict/keras predict` ratios are worked out
from the timings, without a spread, and their CPU is "unknown".

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from typing import Callable

# What a `results.csv` must hold (the first columns of every version).
_NEEDED = ("section", "model", "replicas", "path", "ms_per_step")


@dataclasses.dataclass
class Run:
  """One suite run as read back from its CSV.

  Attributes:
    figures: name -> `(value, low, high)`; `low`/`high` are `None` without
      a spread.
    timings: `(section, model, replicas, path)` -> ms per step (for
      inference: ms per pass over the inputs).
  """
  path: str
  cpu: str
  machine: str
  figures: dict[str, tuple[float, float | None, float | None]]
  timings: dict[tuple[str, str, str, str], float]


def _number(text: str | None) -> float | None:
  try:
    value = float(text) if text not in (None, "") else None
  except ValueError:
    return None
  return value if value is not None and math.isfinite(value) else None


def read_run(path: str) -> Run:
  """Reads a suite's `results.csv`.

  Raises:
    FileNotFoundError: `path` does not exist (named in the message).
    ValueError: a CSV without the suite's columns.
  """
  try:
    with open(path, newline="") as f:
      lines = list(csv.DictReader(f))
      columns = set(lines[0]) if lines else set()
  except FileNotFoundError:
    raise FileNotFoundError(
        f"--compare file {path!r} does not exist. Pass the results.csv that "
        "`python -m tfmgpu.bench` wrote (in its --output_dir).") from None
  missing = [c for c in _NEEDED if c not in columns]
  if missing:
    raise ValueError(f"--compare file {path!r} is not a bench results.csv: "
                     f"it lacks the columns {missing}. Pass the results.csv "
                     "that `python -m tfmgpu.bench` wrote.")
  run = Run(path, lines[0].get("cpu") or "unknown CPU",
            lines[0].get("machine") or "", {}, {})
  for line in lines:
    if line["section"] == "figure":
      value = _number(line.get("value"))
      if value is not None:
        run.figures[line["path"]] = (value, _number(line.get("low")),
                                     _number(line.get("high")))
      continue
    ms = _number(line["ms_per_step"])
    if ms is not None:
      key = (line["section"], line["model"], line["replicas"], line["path"])
      run.timings[key] = ms
  if not run.figures:
    run.figures = _derived_figures(run.timings)
  return run


def _derived_figures(timings: dict[tuple[str, str, str, str], float]
                     ) -> dict[str, tuple[float, None, None]]:
  """The tfmgpu/baseline ratios of a CSV that holds no figures."""
  figures = {}
  for (section, model, replicas, path), ms in timings.items():
    if section == "training" and path == "tfmgpu":
      fit = timings.get((section, model, replicas, "keras_fit"))
      name = f"tfmgpu/keras_fit {model} x{replicas}"
    elif section == "inference" and path == "tfmgpu":
      fit = timings.get((section, model, replicas, "keras_predict"))
      name = f"tfmgpu.predict/keras predict x{replicas}"
    else:
      continue
    if fit:
      figures[name] = (fit / ms, None, None)
  return figures


def _cell(figure: tuple[float, float | None, float | None] | None) -> str:
  if figure is None:
    return "-"
  value, low, high = figure
  if low is None or high is None:
    return f"{value:.3f}"
  return f"{value:.3f} ({low:.2f}-{high:.2f})"


def _union(first: dict, second: dict) -> list:
  """The keys of `first` in order, then those only `second` has."""
  return list(first) + [k for k in second if k not in first]


def compare_runs(a: Run, b: Run, out: Callable[[str], None] = print) -> None:
  """Prints the figures and timings of runs `a` and `b` side by side."""
  machines = f"A [{a.cpu}] | B [{b.cpu}]"
  out(f"A: {a.path}\n   {a.machine or a.cpu}")
  out(f"B: {b.path}\n   {b.machine or b.cpu}")
  out(f"\n== Headline figures: {machines} ==")
  out("  (a ratio of the best rounds, then the lowest and highest ratio of "
      "one round)")
  out(f"  {'figure':<52} {'A':<20} B")
  for name in _union(a.figures, b.figures):
    out(f"  {name:<52} {_cell(a.figures.get(name)):<20} "
        f"{_cell(b.figures.get(name)):<20}".rstrip())
  out(f"\n== Timings, ms per step (inference: per pass): {machines} ==")
  out(f"  {'section':<16} {'model':<8} {'x':>2} {'path':<40} {'A':>9} "
      f"{'B':>9} {'B/A':>6}")
  for key in _union(a.timings, b.timings):
    section, model, replicas, path = key
    ta, tb = a.timings.get(key), b.timings.get(key)
    cells = [f"{t:9.3f}" if t is not None else f"{'-':>9}" for t in (ta, tb)]
    ratio = f"{tb / ta:6.2f}" if ta and tb else f"{'-':>6}"
    out(f"  {section:<16} {model:<8} {replicas:>2} {path[:40]:<40} "
        f"{cells[0]} {cells[1]} {ratio}")
