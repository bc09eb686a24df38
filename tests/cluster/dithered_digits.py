"""The shipped digits with a little noise added, for the cluster parity tests.

Max-pooling over the digits' exact-zero backgrounds has ties, and a
rounding difference between two runs (one process vs two workers add the
per-example gradients in different orders: 3e-7 apart after one step) can
flip which pixel gets the gradient; Adam turns that into a full step, and
over 90 steps the two runs drift 1e-2 apart. Dithered pixels have no ties,
so the runs stay within float32 rounding of each other whatever the
optimizer's arithmetic (docs: /work/shared/DESIGN.md, "Parity tests on
digits").
"""

import numpy as np

from tfmgpu import data


def load(seed: int = 0):
  """`digits` (same split for `seed`) plus uniform noise of 1e-3."""
  arrays = data.load_dataset("digits", seed=seed)
  rng = np.random.default_rng(1234)
  noise = lambda x: (x + rng.uniform(0, 1e-3, x.shape)).astype(np.float32)
  return ((noise(arrays.x_train), arrays.y_train),
          (noise(arrays.x_test), arrays.y_test))
