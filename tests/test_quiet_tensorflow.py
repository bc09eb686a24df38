"""CLI output without TensorFlow's own chatter (tfmgpu.tf_logs)."""

import logging
import os
import re
import subprocess
import sys

import pytest

from tfmgpu import tf_logs

# A line of TF's C++ logging: `E0000 00:00:1796258865.469782   29897
# cuda_platform.cc:52] failed call to cuInit: ...` (tfmgpu's own absl lines
# name a .py file).
CPP_ERROR_OR_WARNING = re.compile(r"^[EW]\d{4} [\d:.]+ +\d+ \S+\.cc:\d+\] ",
                                  re.M)
BANNER = ("WARNING: All log messages before absl::InitializeLog() is called "
          "are written to STDERR\n")
ONEDNN = ("I0000 00:00:1796258863.403359   29897 port.cc:153] oneDNN custom "
          "operations are on.\n")
CUDART = ("I0000 00:00:1796258863.403740   29897 cudart_stub.cc:31] Could not "
          "find cuda drivers on your machine, GPU will not be used.\n")
CUINIT = ("E0000 00:00:1796258865.469782   29897 cuda_platform.cc:52] failed "
          "call to cuInit: UNKNOWN ERROR (303)\n")
PY_WARNING = "/x/y.py:3: DeprecationWarning: old\n  import y\n"
# What `import tensorflow` writes: two runtime copies log the same lines.
STARTUP = (BANNER + ONEDNN + CUDART + PY_WARNING + CUINIT
           + BANNER + ONEDNN.replace("403359", "999999") + CUDART)


def test_quiet_keeps_only_what_is_not_tf_logging():
  assert tf_logs.filter_startup_log(STARTUP, 3) == PY_WARNING


def test_error_level_keeps_errors_once():
  assert tf_logs.filter_startup_log(STARTUP, 2) == PY_WARNING + CUINIT


def test_default_level_prints_the_startup_lines_once():
  assert tf_logs.filter_startup_log(STARTUP, 0) == (
      BANNER + ONEDNN + CUDART + PY_WARNING + CUINIT)


def _record(pathname: str, level: int, msg: str = "m") -> logging.LogRecord:
  return logging.LogRecord("absl", level, pathname, 1, msg, (), None)


def test_tensorflow_info_records_are_dropped_and_others_kept():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  saver = os.path.join(os.path.dirname(tf.__file__), "python", "checkpoint",
                       "functional_saver.py")
  keep = tf_logs._TensorFlowInfoFilter().filter  # pylint: disable=protected-access
  assert not keep(_record(saver, logging.INFO))
  assert keep(_record(saver, logging.WARNING))
  assert keep(_record(tf_logs.__file__, logging.INFO))
  # TF's own checkpoint writer retracing (each save of a parameter-server
  # run printed it); a user's function retracing is still said.
  retracing = os.path.join(os.path.dirname(tf.__file__), "python", "eager",
                           "polymorphic_function", "polymorphic_function.py")
  said = ("6 out of the last 6 calls to <function {}.<locals>.{} at 0x7f> "
          "triggered tf.function retracing. Tracing is expensive ...")
  assert not keep(_record(retracing, logging.WARNING, said.format(
      "MultiDeviceSaver.save", "tf_function_save")))
  assert keep(_record(retracing, logging.WARNING, said.format(
      "my_step", "inner")))


@pytest.fixture
def restored_absl_filters():
  loggers = [logging.getLogger(name) for name in ("absl", "tensorflow")]
  before = [list(logger.filters) for logger in loggers]
  yield
  for logger, filters in zip(loggers, before):
    logger.filters[:] = filters


@pytest.mark.usefixtures("restored_absl_filters")
@pytest.mark.parametrize("user_value, tensorflow_logs, expected", [
    (None, False, "3"), ("1", False, "1"), (None, True, None),
    ("0", True, "0")])
def test_log_level(monkeypatch, user_value, tensorflow_logs, expected):
  if user_value is None:
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
  else:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", user_value)
  tf_logs.quiet_tensorflow(tensorflow_logs=tensorflow_logs)
  assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == expected


def _train(tmp_path, *args):
  env = dict(os.environ)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  env["TFMGPU_CACHE_DIR"] = str(tmp_path / "cache")
  out = subprocess.run(
      [sys.executable, "-m", "tfmgpu.train", "--strategy=mirrored",
       "--epochs=1", "--steps_per_epoch=2", f"--model_dir={tmp_path / 'run'}",
       *args], capture_output=True, text=True, timeout=300, env=env,
      check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout + out.stderr


@pytest.mark.slow
def test_train_prints_no_tensorflow_errors_or_warnings(tmp_path):
  """Nor does it leave a user of one CPU without the way to simulate more
  devices."""
  text = _train(tmp_path)
  assert not CPP_ERROR_OR_WARNING.findall(text), text[-3000:]
  assert "Sharding callback duration" not in text
  assert "absl::InitializeLog" not in text
  assert "test loss / accuracy" in text
  assert "--virtual_devices=N" in text


@pytest.mark.slow
def test_verbose_2_shows_tensorflow_logs_once(tmp_path):
  text = _train(tmp_path, "--verbose=2")
  records = re.findall(r"^[IWE]0000 [\d:.]+ +\d+ (\S+\.cc:\d+\] .*)$", text,
                       re.M)
  assert records, text[-3000:]  # TF's own start-up lines are shown...
  assert len(records) == len(set(records)), records  # ...once each.
  assert text.count("absl::InitializeLog") <= 1


@pytest.mark.parametrize("level, noisy", [(None, False), ("0", True)])
def test_import_tfmgpu_quiets_tf_start_up_unless_the_user_set_a_level(
    level, noisy):
  """Issue 29 item 11: `import tfmgpu` then TF printed a red `E0000 ...
  cuInit` line on CPU hosts; a user's own level is kept."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  if level is not None:
    env["TF_CPP_MIN_LOG_LEVEL"] = level
  out = subprocess.run(
      [sys.executable, "-c", "import tfmgpu, tensorflow as tf; "
       "print(tf.constant(1).numpy())"],
      capture_output=True, text=True, env=env, timeout=300, check=True)
  assert out.stdout.strip() == "1"
  if noisy:  # The user's level 0: TF's lines, as TF prints them.
    assert re.search(r"^[IEW]\d{4} [\d:.]+ +\d+ \S+\.cc:\d+\] ",
                     out.stderr, re.M), out.stderr
  else:  # No E or W line (TF prints its I lines before it reads the level).
    assert not CPP_ERROR_OR_WARNING.search(out.stderr), out.stderr
