"""Exit 42 stays 42: a second SIGTERM after the preemption save is ignored.

A subprocess trains, gets SIGTERM (from itself, at step 2), saves and
catches `PreemptedError`; the test then sends a second SIGTERM (a scheduler
resending it) and lets the process exit. With
`hold_sigterm_after_preemption()` (what the CLI calls) it exits with 42;
without it (a library caller) the previous handler is back and SIGTERM kills
it, which shows the test can tell the two apart.
"""

import os
import selectors
import signal
import subprocess
import sys

import pytest

from tfmgpu.training import checkpoints

IMPORTS = r"""
import os, signal, sys
import keras
import numpy as np
import tfmgpu
from tfmgpu import models
from tfmgpu.training import checkpoints, preemption
from tfmgpu.training.loop import Trainer
"""

# Trains a few steps, sends itself SIGNAL after step 2 and catches the
# `PreemptedError` of the save; the lines after it continue its `except`.
TRAIN_UNTIL_SIGNAL = r"""
class SignalAtStep2(keras.callbacks.Callback):
  def on_train_batch_end(self, batch, logs=None):
    if batch == 1:
      os.kill(os.getpid(), signal.SIGNAL)


strategy = tfmgpu.get_strategy("one_device")
with strategy.scope():
  model = models.build_model("mlp", input_shape=(8,), num_classes=3, seed=0)
rng = np.random.default_rng(0)
x = rng.random((64, 8), dtype=np.float32)
y = rng.integers(0, 3, 64).astype(np.int32)
trainer = Trainer(model, strategy=strategy, verbose=0, steps_per_execution=1,
                  model_dir=sys.argv[1], callbacks=[SignalAtStep2()])
try:
  trainer.fit(x, y, epochs=2, global_batch_size=16, steps_per_epoch=4)
except checkpoints.PreemptedError as e:
  print("saved", e.checkpoint, flush=True)
"""

CHILD = IMPORTS + r"""
if sys.argv[2] == "hold":
  preemption.hold_sigterm_after_preemption()
""" + TRAIN_UNTIL_SIGNAL.replace("SIGNAL", "SIGTERM") + r"""
  sys.stdin.readline()  # The test has sent the second SIGTERM by now.
  print("exiting", flush=True)
  sys.exit(checkpoints.EXIT_PREEMPTED)
sys.exit(1)
"""

TIMEOUT_S = 120


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
  """The child's next stdout line, or a failure after `timeout_s`."""
  with selectors.DefaultSelector() as selector:
    selector.register(proc.stdout, selectors.EVENT_READ)
    if not selector.select(timeout_s):
      proc.kill()
      pytest.fail(f"no output from the child within {timeout_s} s")
  return proc.stdout.readline()


@pytest.mark.parametrize("mode,exit_code", [
    ("hold", checkpoints.EXIT_PREEMPTED), ("restore", -signal.SIGTERM)])
def test_a_second_sigterm_after_the_save(tmp_path, mode, exit_code):
  stderr_path = tmp_path / "stderr.txt"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  with open(stderr_path, "w") as stderr:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "run"), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        text=True, env=env)
    try:
      line = _read_line(proc, TIMEOUT_S)
      assert line.startswith("saved "), (line, stderr_path.read_text())
      assert os.path.exists(line.split()[1] + ".index")
      proc.send_signal(signal.SIGTERM)  # The scheduler resends it.
      try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
      except BrokenPipeError:  # Already killed (the "restore" case).
        pass
      assert proc.wait(timeout=TIMEOUT_S) == exit_code, stderr_path.read_text()
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=TIMEOUT_S)
  ignored = ("SIGTERM again after the preemption checkpoint was saved: "
             "ignored; exiting with code 42.")
  assert (ignored in stderr_path.read_text()) == (mode == "hold")


CTRL_C_CHILD = IMPORTS + r"""
preemption.interrupt_saves()  # What `python -m tfmgpu.train` calls.
try:  # No training runs: Ctrl-C interrupts at once.
  os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
  print("interrupted outside training", flush=True)
preemption.interrupt_saves()
""" + TRAIN_UNTIL_SIGNAL.replace("SIGNAL", "SIGINT") + r"""
  print(str(e).split(". Saved")[0], flush=True)
"""


def test_ctrl_c_in_a_cli_run_saves_as_sigterm_does(tmp_path):
  """Ctrl-C killed `python -m tfmgpu.train` with a traceback and lost the
  epoch's steps since the last checkpoint; now it saves at the next step
  (exit 42 in the CLI), and interrupts at once when nothing trains."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  out = subprocess.run([sys.executable, "-c", CTRL_C_CHILD,
                        str(tmp_path / "run")], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT_S, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0] == "interrupted outside training", out.stdout
  assert lines[1].startswith("saved "), out.stdout
  assert os.path.exists(lines[1].split()[1] + ".index")
  assert lines[2] == "Preempted: Ctrl-C reached this process", out.stdout
  assert "Ctrl-C: saving a checkpoint at the next step boundary" in out.stderr
  assert "SIGTERM received" not in out.stderr  # One line says what happens.


BLOCKED_CHILD = r"""
import os, signal, sys, threading
import tensorflow as tf
from tfmgpu.training import preemption
preemption.STOP_AT_ONCE_WAIT_S = 0.5
preemption.sigterm_stops_at_once(said="error: stopped (what is kept).")
queue = tf.queue.FIFOQueue(1, tf.int32)
queue.enqueue(0)
queue.dequeue()  # Its kernels made: the next dequeue blocks at once.
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
threading.Timer(20, queue.enqueue, (1,)).start()  # Unblocks it at last.
try:
  queue.dequeue()  # Inside TensorFlow: Python runs no signal handler here.
except preemption.SigtermOutsideSteps:
  print("stopped after the call returned", flush=True)
os._exit(1)
"""


def test_sigterm_inside_a_blocked_tensorflow_call_exits_42_soon():
  """SIGTERM outside the steps while the main thread waits in TensorFlow
  (a collective on a lost peer, a long evaluation): the handler ran only
  when the call returned (87 s later in review r2, or never), so the
  launcher's SIGKILL came first. Now a watchdog thread says what is kept
  and exits 42 once `STOP_AT_ONCE_WAIT_S` passed (here the call would
  return after 20 s, with exit 1)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  out = subprocess.run([sys.executable, "-c", BLOCKED_CHILD],
                       capture_output=True, text=True, env=env,
                       timeout=TIMEOUT_S, check=False)
  assert out.returncode == checkpoints.EXIT_PREEMPTED, (out.stdout,
                                                        out.stderr[-3000:])
  assert out.stderr.splitlines()[-1] == "error: stopped (what is kept)."
  assert "did not stop within 0.5s (inside a TensorFlow call)" in out.stderr
  assert out.stdout == ""
