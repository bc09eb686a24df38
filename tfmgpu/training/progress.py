"""`EpochProgress`: one epoch's progress on stdout, readable in a log file.

On a terminal (or a notebook) one line is rewritten in place as steps run;
anywhere else (a log file, a pipe, a scheduler's capture) a single plain
line is printed when the epoch ends: no carriage returns, no ANSI colour
codes (Keras's `Progbar` writes both, and one line per update, to files).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import IO

_INTERVAL_S = 0.1  # Rewrites of a terminal line at most this often.


def is_interactive(stream: IO[str]) -> bool:
  """`stream` shows a rewritten line as one line: a terminal or a notebook."""
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty()) or _in_notebook_kernel()


def _in_notebook_kernel() -> bool:
  """Running inside a Jupyter kernel (not merely with ipykernel imported,
  as a test runner that executes notebooks has it)."""
  ipython = sys.modules.get("IPython")
  shell = ipython.get_ipython() if ipython is not None else None
  return getattr(shell, "kernel", None) is not None


def format_logs(logs: Mapping[str, float], rate: float | None = None) -> str:
  """`loss: 0.1234 - accuracy: 0.9620 - examples/s: 309`."""
  parts = [f"{k}: {v:.4f}" if abs(v) >= 1e-3 or v == 0 else f"{k}: {v:.3e}"
           for k, v in logs.items()]
  if rate is not None:
    parts.append(f"examples/s: {rate:,.0f}")
  return " - ".join(parts)


class EpochProgress:
  """Progress of epoch `epoch` (1-based) of `epochs`, `steps` steps long.

  Args:
    epoch, epochs, steps: where the run is (`steps` `None`: not known,
      shown as `?`).
    stream: where to write. Defaults to `sys.stdout`.
    interactive: rewrite a line in place; `None`: when `stream` is a
      terminal or a notebook (`is_interactive`).
    title: what the line is of. Defaults to `Epoch {epoch}/{epochs}`
      (predict's: `Predict`, counting rows).
  """

  def __init__(self, epoch: int, epochs: int, steps: int | None, *,
               stream: IO[str] | None = None,
               interactive: bool | None = None, title: str | None = None):
    self.stream = stream or sys.stdout
    self.interactive = (is_interactive(self.stream) if interactive is None
                        else interactive)
    self.epoch, self.epochs, self.steps = epoch, epochs, steps
    self.title = title or f"Epoch {epoch}/{epochs}"
    self._start = time.perf_counter()
    self._written = 0.0
    self._width = 0
    self._line = ""
    if self.interactive:
      self._write(f"{self.title}\n")

  def update(self, done: int, logs: Mapping[str, float], rate: float) -> None:
    """`done` steps of the epoch, with the running `logs` and examples/s."""
    steps = "?" if self.steps is None else self.steps
    seconds = time.perf_counter() - self._start
    self._line = (f"{done:>{len(str(steps))}}/{steps} - {seconds:.0f}s - "
                  f"{format_logs(logs, rate)}")
    now = time.perf_counter()
    last = self.steps is not None and done >= self.steps
    if self.interactive and (now - self._written >= _INTERVAL_S or last):
      self._written = now
      self._rewrite()

  def _rewrite(self) -> None:
    pad = " " * max(0, self._width - len(self._line))
    self._write(f"\r{self._line}{pad}")
    self._width = len(self._line)

  def end(self) -> None:
    """Ends the epoch's line (off a terminal: prints it, once)."""
    if self.interactive:
      if self.steps is None and self._line:  # Its last update, if skipped.
        self._rewrite()
      self._write("\n")
    elif self._line:
      self._write(f"{self.title}: {self._line}\n")

  def _write(self, text: str) -> None:
    self.stream.write(text)
    self.stream.flush()
