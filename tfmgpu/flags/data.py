"""`--dataset` and `--data_path`."""

from absl import flags

from tfmgpu import data as data_lib
from tfmgpu import user_code

DATASET = flags.DEFINE_string(
    "dataset", None,
    f"<{' | '.join(data_lib.available_datasets())}>, or your own loader as "
    f"{user_code.FORMS}, called as load() (with seed=/path= if it takes "
    "them) and returning ((x_train, y_train), (x_test, y_test)) like "
    "keras.datasets (x may be a dict of arrays), or what Trainer.fit takes: "
    "a tf.data.Dataset of (x, y) batches, a dataset function, or a (train, "
    "test) pair of them. Default: train: the model's own (gpt: "
    "stdlib_text), else digits (real digits that ship offline); predict: "
    "the dataset the model's run trained on (its run.json, which names your "
    "files by absolute path), else digits.")
DATA_PATH = flags.DEFINE_string(
    "data_path", None, ".npz file (x_train, y_train, x_test, y_test) for "
    "--dataset=npz, a glob of TFRecord shards for --dataset=tfrecord "
    "(quoted: 'DIR/*.tfrecord'), or a local copy of a downloadable dataset.")


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
