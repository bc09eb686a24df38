"""Test set-up: split the CPU into logical devices once, before any TF op.

Every multi-device path in the suite runs on these logical CPUs. The shared
fixtures below are defined here once: the digits dataset (loaded once per
session: a load takes seconds) and the parsed-flags state the CLI tests need.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

import tfmgpu  # pylint: disable=g-import-not-at-top
from tfmgpu import data  # pylint: disable=g-import-not-at-top

# 4 logical CPUs; `tests/parallel/test_3d.py` runs in a process of its own
# with 8 (TFMGPU_TEST_DEVICES=8, started by `test_hybrid.py`).
NUM_LOGICAL_DEVICES = int(os.environ.get("TFMGPU_TEST_DEVICES", "4"))


def pytest_configure(config):
  """Splits the CPU before any test module is imported. Not in
  pytest-xdist's controller (`-n 2`), which runs no test: there it would
  only import TensorFlow and print its start-up lines after the summary."""
  if (getattr(config, "workerinput", None) is None
      and config.getoption("numprocesses", default=None)):
    return
  tfmgpu.configure_devices(logical_cpus=NUM_LOGICAL_DEVICES)


@pytest.fixture
def cpu_devices():
  """The logical CPU device names, e.g. ['/device:CPU:0', ...]."""
  return tfmgpu.list_devices("CPU")


@pytest.fixture(scope="session")
def digits_arrays():
  """The real `digits` dataset (`data.Arrays`), loaded once per session.

  Every test shares these arrays, so they are read-only: copy before
  changing one.
  """
  arrays = data.load_dataset("digits")
  for a in (arrays.x_train, arrays.y_train, arrays.x_test, arrays.y_test):
    a.setflags(write=False)
  return arrays


@pytest.fixture(scope="module")
def digits(request, digits_arrays):
  """`(x, y)`: the first `DIGITS_ROWS` training digits of the test module.

  A module that uses this fixture sets `DIGITS_ROWS`: the row count decides
  each epoch's shuffled order, so every module keeps its own.
  """
  rows = getattr(request.module, "DIGITS_ROWS", None)
  if rows is None:
    raise ValueError(f"{request.module.__name__} uses the `digits` fixture "
                     "but sets no DIGITS_ROWS. Set DIGITS_ROWS = <rows>.")
  return digits_arrays.x_train[:rows], digits_arrays.y_train[:rows]


@pytest.fixture(scope="module")
def dithered_digits(digits):
  """`digits`, dithered by up to 0.01, for the float32 parity.

  The digits' backgrounds are exactly 0, so many max-pool windows of the
  convnet hold exact ties, and near-ties whose winner a 1e-8 rounding
  difference (a sum of two half-batch gradients vs one full-batch gradient)
  can flip; a flipped winner routes that pixel's gradient elsewhere, and
  Adam turns it into a full-size step. Undithered, one of six seeds ended
  3e-3 apart after 6 steps (fused Adam, one thread per op); dithered, all
  six stayed within 2e-7. The dithering removes the exact ties, not the
  data-parallel arithmetic under test.
  """
  x, y = digits
  return x + np.random.default_rng(0).uniform(0, 0.01, x.shape).astype(
      x.dtype), y


@pytest.fixture
def float64_keras():
  """`keras.config.floatx()` and the layers' dtype policy float64 for one
  test, then as they were (the policy, once read, no longer follows
  floatx: restoring floatx alone leaves later tests' models float64)."""
  import keras  # pylint: disable=g-import-not-at-top
  floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
  keras.config.set_floatx("float64")
  keras.config.set_dtype_policy("float64")
  yield
  keras.config.set_floatx(floatx)
  keras.config.set_dtype_policy(policy)


@pytest.fixture
def parsed_flags():
  """Marks absl's FLAGS parsed, so CLI `main`s can run in-process."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True)
def _absl_logs_reach_caplog():
  """Each test starts with absl's INFO records flowing to `caplog`.

  Something earlier in a session (an in-process CLI run, a Jupyter client's
  `logging.config`, which disables existing loggers) can leave the `absl`
  logger quieter, disabled or not propagating; tests that read the log
  would then see nothing. Restored after the test.
  """
  import logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  logger = logging.getLogger("absl")
  saved = (absl_logging.get_verbosity(), logger.disabled, logger.propagate,
           logging.root.manager.disable)
  absl_logging.set_verbosity(absl_logging.INFO)
  logger.disabled, logger.propagate = False, True
  logging.disable(logging.NOTSET)
  yield
  absl_logging.set_verbosity(saved[0])
  logger.disabled, logger.propagate = saved[1], saved[2]
  logging.disable(saved[3])
