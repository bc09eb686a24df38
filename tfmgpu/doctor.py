r"""Describe this machine and how to train on it with tfmgpu.

Prints the software, GPUs, CPU, cluster environment and logical devices, then
the strategy, cross-device ops and mixed precision policy that pay off here,
with the command line to start with.

  python -m tfmgpu.doctor
  python -m tfmgpu.doctor --json
  python -m tfmgpu.doctor --model_memory_gb=30
"""

from collections.abc import Sequence

from absl import app
from absl import flags

from tfmgpu import flags as flags_lib
from tfmgpu.flags import cli

_JSON = flags.DEFINE_bool(
    "json", False, "Print machine-readable JSON instead of text.")
_MODEL_MEMORY_GB = flags.DEFINE_float(
    "model_memory_gb", None,
    "Memory (GiB) one replica of your model needs to train, if known; above "
    "one GPU's memory a pipeline/model-parallel placement is recommended; "
    "without GPUs it is compared with the host's RAM.",
    lower_bound=1e-9)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  flags_lib.quiet_tensorflow()
  # Imported here so that --help answers without loading TensorFlow.
  from tfmgpu import diagnostics  # pylint: disable=g-import-not-at-top
  report = diagnostics.collect()
  recs = diagnostics.recommend(report, model_memory_gb=_MODEL_MEMORY_GB.value)
  if _JSON.value:
    print(diagnostics.to_json(report, recs))
  else:
    print(diagnostics.format_report(report, recs))


def run() -> None:
  """Console-script entry point (`tfmgpu-doctor`)."""
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
