"""Test set-up: split the CPU into logical devices once, before any TF op.

Every multi-device path in the suite runs on these logical CPUs.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top

import tfmgpu  # pylint: disable=g-import-not-at-top

NUM_LOGICAL_DEVICES = 4

tfmgpu.configure_devices(logical_cpus=NUM_LOGICAL_DEVICES)


@pytest.fixture
def cpu_devices():
  """The logical CPU device names, e.g. ['/device:CPU:0', ...]."""
  return tfmgpu.list_devices("CPU")
