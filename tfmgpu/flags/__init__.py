"""Flag groups of the CLIs, each defined once.

A CLI imports the groups it reads, and only those, so no CLI accepts a flag
it ignores; a flag shared by several CLIs has one name, help and choice
list (choices come from the registries). Two CLIs can be imported in one
process. Library code never imports this package.

* `devices`: `--virtual_devices` (train, predict, bench).
* `strategy`: `--strategy` and the replica-device options (train, predict).
* `data`: `--dataset`, `--data_path` (train, predict).
* `stages`: how a model is cut into stages (train, predict).
* `execution`: `--steps_per_execution` (train, predict, bench).
* `batch`: `--global_batch_size` (train, bench).
"""

from __future__ import annotations


def quiet_tensorflow() -> None:
  """Keeps TF's INFO chatter and a known tf.data warning out of CLI output."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  py_logging.getLogger("tensorflow").setLevel(py_logging.WARNING)
  warnings.filterwarnings(
      "ignore", message="To make it possible to preserve tf.data options")
