"""`--dataset` and `--data_path`."""

from absl import flags

from tfmgpu import data as data_lib

DATASET = flags.DEFINE_enum(
    "dataset", "digits", list(data_lib.available_datasets()),
    "Dataset; 'digits' ships offline.")
DATA_PATH = flags.DEFINE_string(
    "data_path", None, ".npz file (x_train, y_train, x_test, y_test) for "
    "--dataset=npz, or a local copy of a downloadable dataset.")
