"""`--dataset` and `--data_path`."""

from absl import flags

from tfmgpu import data as data_lib
from tfmgpu import flags as flags_lib
from tfmgpu.config import TrainConfig

_FLAGS = flags_lib.define_settings(TrainConfig, ["dataset", "data_path"],
                                   module_name=__name__)
DATASET = _FLAGS["dataset"]
DATA_PATH = _FLAGS["data_path"]


@flags.validator("dataset")
def _known_dataset(value: str | None) -> bool:
  """A registered name, or a reference whose module defines the loader
  (read, not imported: before TensorFlow loads); `None`: the default."""
  if value is None:
    return True
  try:
    data_lib.check_dataset(value)
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  return True
