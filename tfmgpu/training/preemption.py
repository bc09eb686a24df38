"""Catch SIGTERM (preemption notice) and agree on it across workers.

`PreemptionWatcher` records SIGTERM while training runs. At a step boundary
the loop asks `stop_requested()`; under a multi-worker collective strategy
the answer is all-reduced over the workers, so every worker stops (and
saves) after the same step even though only one received the signal.

Why not `tf.distribute.experimental.PreemptionCheckpointHandler`: it counts
its own `run` calls rather than steps, restores through a CheckpointManager
of its own, does nothing on GCP CPU VMs and refuses parameter-server
clusters. One tiny all-reduce per `tf.function` call (which also carries
a callback's `stop_training`) does the same job through the existing
`Checkpointer`.

Outside the training steps (before them, in the final evaluation, while
the model is saved) the CLI stops at once on SIGTERM and exits 42 too
(`sigterm_stops_at_once`): the checkpoints hold what was trained. Inside
a long TensorFlow call, where Python runs no signal handler, a watchdog
thread exits 42 a few seconds after the SIGTERM instead.

Exit 42 stays 42: SIGTERM is only recorded from the moment training stops
for it (and saves) until the watcher exits. A process that then exits with
`EXIT_PREEMPTED` (the CLI) calls `hold_sigterm_after_preemption()` first, so
that a second SIGTERM (a scheduler resending it, a launcher stopping the
other tasks) is logged and ignored instead of killing it with 143 ("killed
without saving") after the checkpoint was saved. Likewise after training
stopped because a peer task was lost (`tf.errors.UnavailableError`): the
launcher's SIGTERM to the survivors no longer kills one before it said so
(`tfmgpu.training.lost_tasks`). A SIGTERM that the launcher sent says why
(`tfmgpu.stop_notes`: "SIGTERM from the launcher, which stops every task
because worker:1 exited with code 1").
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from absl import logging
import tensorflow as tf

from tfmgpu import in_graph
from tfmgpu import stop_notes
from tfmgpu.training import checkpoints as ckpt_lib
from tfmgpu.training import workers

_HOLD_AFTER_PREEMPTION = False


def hold_sigterm_after_preemption(hold: bool = True) -> None:
  """Keeps SIGTERM ignored after a preemption save (or training stopped by a
  lost peer task), until the process exits.

  For a process that exits with `EXIT_PREEMPTED` when `PreemptedError`
  reaches it (`python -m tfmgpu.train`): a watcher that stopped training for
  SIGTERM then leaves a handler that logs and ignores further SIGTERMs
  instead of restoring the previous one. Other callers (a notebook, tests)
  get the previous handler back, as without this call.

  Args:
    hold: `False` turns it off again.
  """
  global _HOLD_AFTER_PREEMPTION
  _HOLD_AFTER_PREEMPTION = hold


_WATCHING: list["PreemptionWatcher"] = []  # Watchers inside their `with`.
_INTERRUPTED = threading.Event()  # The SIGTERM was a Ctrl-C, forwarded.


def signal_name() -> str:
  """What stopped this process's training: `"Ctrl-C"` (`interrupt_saves`)
  or `"SIGTERM"`."""
  return "Ctrl-C" if _INTERRUPTED.is_set() else "SIGTERM"


def interrupt_saves(on: bool = True) -> None:
  """Makes Ctrl-C (SIGINT) stop a CLI run as SIGTERM does: a checkpoint at
  the next step boundary, then `PreemptedError` (exit 42; the same command
  resumes). A second Ctrl-C, or one while no training runs, interrupts at
  once (`KeyboardInterrupt`). Main thread only; `False` restores Python's
  handler. Not for notebooks: there Ctrl-C interrupts the cell."""
  if threading.current_thread() is not threading.main_thread():
    return
  _INTERRUPTED.clear()
  signal.signal(signal.SIGINT,
                _interrupt_as_sigterm if on else signal.default_int_handler)


def _interrupt_as_sigterm(signum, frame) -> None:
  signal.signal(signal.SIGINT, signal.default_int_handler)  # Next: at once.
  if not _WATCHING:
    signal.default_int_handler(signum, frame)  # No step loop to stop.
  logging.warning("Ctrl-C: saving a checkpoint at the next step boundary, "
                  "then stopping (Ctrl-C again stops at once).")
  _INTERRUPTED.set()
  os.kill(os.getpid(), signal.SIGTERM)


class SigtermOutsideSteps(BaseException):
  """SIGTERM reached a CLI run outside its training steps (before them, in
  the final evaluation, while `model.keras` was saved): it stopped at once,
  as Ctrl-C does (`sigterm_stops_at_once`). A `BaseException`, like
  `KeyboardInterrupt`, so that no `except Exception` swallows it."""


# Seconds the main thread has, after SIGTERM outside the steps, to stop;
# then the watchdog exits. Python runs a signal handler only between
# bytecodes: in a long or hung TensorFlow call (a collective waiting on a
# lost peer, a long evaluation) it would wait, and the launcher SIGKILL.
STOP_AT_ONCE_WAIT_S = 5.0
_STOPPED = threading.Event()  # The main thread has stopped (or turned off).
_WAKEUP: list[int] = []  # The wakeup pipe's write end and the previous fd.


def sigterm_stops_at_once(on: bool = True, *, said: str = "") -> None:
  """For a process that exits with `EXIT_PREEMPTED` (the train CLI):
  SIGTERM outside a `PreemptionWatcher` (which saves at a step boundary)
  raises `SigtermOutsideSteps` in the main thread instead of killing the
  process with 143 and no word; the checkpoints already saved are kept. A
  second SIGTERM while it stops is logged and ignored. If the main thread
  has not stopped `STOP_AT_ONCE_WAIT_S` after the SIGTERM (it is inside a
  TensorFlow call, where Python runs no handler), a watchdog thread prints
  `said` and exits the process with `EXIT_PREEMPTED` itself. Main thread
  only; `False` (called once the CLI has stopped) ends the watchdog and
  restores the default handler (unless it fired: then SIGTERM stays ignored
  until the process exits)."""
  if threading.current_thread() is not threading.main_thread():
    return
  if on:
    _STOPPED.clear()
    signal.signal(signal.SIGTERM, _stop_at_once)
    _watch_sigterm(said)
    return
  _STOPPED.set()
  if signal.getsignal(signal.SIGTERM) is _stop_at_once:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
  if _WAKEUP:
    write_end, previous = _WAKEUP
    _WAKEUP.clear()
    signal.set_wakeup_fd(previous)
    os.close(write_end)  # The watchdog reads the end of the pipe and ends.


def _watch_sigterm(said: str) -> None:
  """Starts the watchdog: the C-level signal handler writes each signal's
  number to a wakeup pipe at once, whatever the main thread is doing."""
  if _WAKEUP:
    return
  read_end, write_end = os.pipe()
  os.set_blocking(write_end, False)
  _WAKEUP[:] = [write_end, signal.set_wakeup_fd(
      write_end, warn_on_full_buffer=False)]
  threading.Thread(target=_watchdog, args=(read_end, said), daemon=True,
                   name="sigterm-watchdog").start()


def _watchdog(read_end: int, said: str) -> None:
  try:
    while numbers := os.read(read_end, 64):
      if signal.SIGTERM in numbers and signal.getsignal(signal.SIGTERM) in (
          _stop_at_once, _ignore_while_stopping):
        break
    else:
      return  # Turned off.
  finally:
    os.close(read_end)
  if _STOPPED.wait(STOP_AT_ONCE_WAIT_S):
    return
  logging.warning("SIGTERM: the main thread did not stop within %gs (inside "
                  "a TensorFlow call); exiting now.", STOP_AT_ONCE_WAIT_S)
  if said:
    print(said, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(ckpt_lib.EXIT_PREEMPTED)  # The main thread cannot be reached.


def _stop_at_once(signum, frame) -> None:
  del signum, frame
  signal.signal(signal.SIGTERM, _ignore_while_stopping)
  raise SigtermOutsideSteps()


def _ignore_while_stopping(signum, frame) -> None:
  del signum, frame
  logging.warning("SIGTERM again while stopping for the first: ignored; "
                  "exiting with code %d.", ckpt_lib.EXIT_PREEMPTED)


def _ignore_after_save(signum, frame) -> None:
  del signum, frame
  logging.warning("SIGTERM again after the preemption checkpoint was saved: "
                  "ignored; exiting with code %d.", ckpt_lib.EXIT_PREEMPTED)


def _ignore_after_loss(signum, frame) -> None:
  del signum, frame
  logging.warning("SIGTERM again after a peer task was lost: ignored while "
                  "this process says so and exits.")


def sigterm_words(note: str | None) -> str:
  """What a SIGTERM to a training process means: a launcher's, with why it
  stops the tasks (`note`, `tfmgpu.stop_notes`: another task ended), or
  one from elsewhere (a scheduler's preemption notice)."""
  if not note:
    return ("SIGTERM received: saving a checkpoint at the next step "
            "boundary, then stopping.")
  return (f"SIGTERM from the launcher, which stops every task because "
          f"{note}: saving a checkpoint at the next step boundary if the "
          "tasks still answer, then stopping.")


class PreemptionWatcher:
  """A context manager that turns SIGTERM into a flag checked between steps.

  Example:
    with PreemptionWatcher(strategy) as watcher:
      for ...:
        train_fn(...)
        if watcher.stop_requested():
          save(); raise PreemptedError(...)

  The previous SIGTERM handler is restored on exit (unless training stopped
  for SIGTERM and `hold_sigterm_after_preemption()` was called: then
  SIGTERM stays ignored until the process exits). Outside the main thread
  (where Python cannot install signal handlers) it watches nothing.

  Args:
    strategy: the run's strategy; under multi-worker mirrored, every worker
      must call `stop_requested()` the same number of times.
  """

  def __init__(self, strategy: tf.distribute.Strategy):
    self.strategy = strategy
    self._received = threading.Event()
    self._previous = None
    self._installed = False
    self._stopping = False  # stop_requested() said yes: a save follows.
    self._any_worker = workers.AnyWorker(strategy)
    self.sender: str | None = None  # A served task's SIGTERM (in-graph).

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    if not self._received.is_set() and not _INTERRUPTED.is_set():
      logging.warning("%s", sigterm_words(stop_notes.read()))
    self._received.set()

  def __enter__(self) -> "PreemptionWatcher":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True
      _WATCHING.append(self)
    else:
      logging.info("Not in the main thread: SIGTERM will not be caught.")
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if not self._installed:
      return
    self._installed = False
    _WATCHING.remove(self)
    preempted = (self._stopping and exc_type is not None
                 and issubclass(exc_type, ckpt_lib.PreemptedError))
    # A lost peer: the launcher stops every task; this one says so first.
    lost = exc_type is not None and issubclass(exc_type,
                                               tf.errors.UnavailableError)
    if (preempted or lost) and _HOLD_AFTER_PREEMPTION:
      signal.signal(signal.SIGTERM,
                    _ignore_after_save if preempted else _ignore_after_loss)
    else:
      signal.signal(signal.SIGTERM, self._previous)

  @property
  def received(self) -> bool:
    """Whether this process received SIGTERM."""
    return self._received.is_set()

  def stop_requested(self) -> bool:
    """Whether any worker received SIGTERM (collective under multi-worker;
    in-graph, a task this one drives: `tfmgpu.in_graph`)."""
    return self.stop_requested_and()[0]

  def stop_requested_and(self, *flags: bool) -> tuple[bool, ...]:
    """`(stop_requested(), *flags on any worker)`: one all-reduce for them
    all under multi-worker mirrored (the controller's vote after a step
    carries a callback's `stop_training` along)."""
    stop, *others = self._any_worker.each(self.received, *flags)
    if not stop and in_graph.driving():
      self.sender = self.sender or in_graph.preempted_task()
      stop = self.sender is not None
    self._stopping = self._stopping or stop
    return (stop, *others)

  @property
  def who(self) -> str:
    """Who received SIGTERM, for messages."""
    if self.received:
      return "this process"
    return f"task {self.sender}" if self.sender else "another worker"

  def any_worker(self, flag: bool) -> bool:
    """Whether `flag` holds on any worker: one all-reduce under multi-worker
    mirrored (every worker must call it as often), else `flag` itself. The
    controller agrees on time-based checkpoints this way."""
    return self._any_worker(flag)
