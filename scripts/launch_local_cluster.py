r"""Runs a command once per task of a local TensorFlow cluster, from a checkout.

The command line of `python -m tfmgpu.launch` (tfmgpu/launch.py); everything
after `--` is the command:

  python scripts/launch_local_cluster.py --num_workers=2 -- \
      python -m tfmgpu.train --strategy=multi_worker_mirrored ...
"""

import pathlib
import sys

from absl import flags

# Run from a checkout: make `tfmgpu` importable without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tfmgpu import launch  # pylint: disable=wrong-import-position

flags.adopt_module_key_flags(launch)  # `--help` lists the launcher's flags.

if __name__ == "__main__":
  launch.run()
