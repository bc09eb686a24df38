"""What a suite run records: one `Row` per timing, headline figures, CSV.

`Report` prints each line as the suite produces it (so a long run shows its
progress) and keeps the rows for `results.csv` and the plots;
`machine_description` is the line that says what machine measured them.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import platform
from typing import Any

from tfmgpu import devices as devices_lib


@dataclasses.dataclass
class Row:
  """One timed path: a line of `results.csv`."""
  section: str
  model: str
  replicas: int
  path: str
  ms_per_step: float
  examples_per_sec: float
  note: str = ""


class Report:
  """Collects rows, prints sections as they finish, writes CSV."""

  def __init__(self, out: Any = print):
    self.rows: list[Row] = []
    self.figures: dict[str, float] = {}
    self._out = out

  def add(self, row: Row) -> None:
    self.rows.append(row)

  def say(self, text: str = "") -> None:
    self._out(text)

  def figure(self, name: str, value: float, rule: str = "") -> None:
    """Records a headline figure (a ratio or fraction) and prints it."""
    self.figures[name] = value
    self.say(f"  {name:<52} {value:8.3f}  {rule}")

  def write_csv(self, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow([f.name for f in dataclasses.fields(Row)])
      for r in self.rows:
        writer.writerow([getattr(r, f.name) for f in dataclasses.fields(Row)])
    return path


def machine_description() -> str:
  """One line: CPU, cores, Python, TF and Keras versions, logical devices and
  threads per op."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  threads = tf.config.threading.get_intra_op_parallelism_threads()
  return (f"{cpu}; {os.cpu_count()} cores; Python {platform.python_version()}; "
          f"TensorFlow {tf.__version__}; Keras {keras.__version__}; "
          f"{len(devices_lib.accelerator_devices())} logical devices, "
          f"{threads or 'all'} thread(s) per op")
