r"""Writes a registry dataset as TFRecord shards, for `--dataset=tfrecord`.

  python scripts/write_tfrecords.py --dataset=digits --output_dir=/data/digits \
      --num_shards=8
  python -m tfmgpu.train --dataset=tfrecord \
      --data_path='/data/digits/*.tfrecord' --strategy=mirrored

Writes `train-0000i-of-0000N.tfrecord` and `test-...` shards (one
`tf.train.Example` per example: raw `x` and `y` bytes) and `tfrecord.json`
(shapes, dtypes, class count, each shard's example count and size) into a new
directory beside `--output_dir`, then renames it into place: the output is
all old or all new, never torn. Format: `tfmgpu/datasets/tfrecord.py`.
"""

import pathlib
import sys

from absl import app
from absl import flags

# Run from a checkout: make `tfmgpu` importable without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# pylint: disable=wrong-import-position
from tfmgpu import data as data_lib
from tfmgpu import flags as flags_lib
from tfmgpu.datasets import tfrecord
from tfmgpu.flags import data

flags.adopt_module_key_flags(data)  # `--help` lists --dataset, --data_path.

_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Directory to write the shards and tfrecord.json to.",
    required=True)
_NUM_SHARDS = flags.DEFINE_integer(
    "num_shards", 8, "Shards per split (train and test).", lower_bound=1)
_SEED = flags.DEFINE_integer(
    "seed", 0, "Seed of the dataset's train/test split (registry datasets "
    "that take one).")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace a non-empty --output_dir.")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  flags_lib.quiet_tensorflow()
  entry = data_lib.dataset_entry(data.DATASET.value)
  values = {"path": data.DATA_PATH.value, "seed": _SEED.value}
  options = {k: v for k, v in values.items()
             if k in entry.options and v is not None}
  try:
    arrays = data_lib.load_dataset(entry.name, **options)
    sidecar = tfrecord.write_shards(arrays, _OUTPUT_DIR.value,
                                    num_shards=_NUM_SHARDS.value,
                                    overwrite=_OVERWRITE.value)
  except (ValueError, FileNotFoundError, FileExistsError,
          data_lib.DatasetUnavailableError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  directory = pathlib.Path(sidecar).parent
  print(f"Wrote {arrays!r} as {_NUM_SHARDS.value} shards per split to "
        f"{directory}.\nTrain with: python -m tfmgpu.train --dataset=tfrecord "
        f"--data_path='{directory}/*.tfrecord'")
  return 0


if __name__ == "__main__":
  app.run(main)
