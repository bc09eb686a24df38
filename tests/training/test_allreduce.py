"""tfmgpu's own all-reduce: clipping the summed gradient, 16-bit compression."""

import numpy as np
import pytest

import tfmgpu
from tfmgpu import models
from tfmgpu.training import allreduce
from tfmgpu.training.loop import Trainer

STEPS, BATCH = 5, 32
DIGITS_ROWS = STEPS * BATCH  # For the `digits` fixture.


def train(strategy, x, y, **kwargs):
  with strategy.scope():
    model = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10,
                               seed=0)
  trainer = Trainer(model, strategy=strategy, learning_rate=1e-2, verbose=0,
                    **kwargs)
  trainer.fit(x, y, epochs=1, global_batch_size=BATCH, steps_per_epoch=STEPS,
              seed=0)
  return model.get_weights()


@pytest.fixture(scope="module")
def one_device_clipped(digits):
  """`(clipped, unclipped)` single-device weights, shared by both replica
  counts."""
  return (train(tfmgpu.get_strategy("one_device"), *digits, clip_norm=0.05),
          train(tfmgpu.get_strategy("one_device"), *digits))


@pytest.fixture(scope="module")
def mirrored_uncompressed(digits):
  """Mirrored x2 weights with float32 all-reduces, shared by both
  compressions."""
  return train(tfmgpu.get_strategy("mirrored", num_replicas=2), *digits)


@pytest.mark.parametrize("replicas", [2, 4])
def test_clipping_applies_to_the_summed_gradient(digits, replicas,
                                                 one_device_clipped):
  """Clipped mirrored training equals clipped single-device training.

  (Keras 3 optimizers clip before their own all-reduce, i.e. each replica's
  partial gradient; tfmgpu sums first, then clips.)
  """
  ref, unclipped = one_device_clipped
  got = train(tfmgpu.get_strategy("mirrored", num_replicas=replicas), *digits,
              clip_norm=0.05)
  assert max(np.abs(a - b).max() for a, b in zip(ref, unclipped)) > 1e-3
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_compressed_all_reduce_halves_bytes_and_stays_close(
    digits, compression, mirrored_uncompressed):
  ref = mirrored_uncompressed
  got = train(tfmgpu.get_strategy("mirrored", num_replicas=2), *digits,
              gradient_compression=compression)
  model = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10,
                             seed=0)
  full = allreduce.all_reduced_bytes(model.trainable_variables)
  assert allreduce.all_reduced_bytes(model.trainable_variables,
                                     compression) * 2 == full
  # 16-bit sums differ from float32 ones in the 3rd-4th digit, and Adam turns
  # a near-zero gradient's flipped sign into a full step; so the stated
  # tolerance is on average: weights differ by < 5% of how far they moved.
  init = model.get_weights()
  diff = sum(np.abs(a - b).sum() for a, b in zip(got, ref))
  moved = sum(np.abs(b - w0).sum() for b, w0 in zip(ref, init))
  assert 0 < diff / moved < 0.05, diff / moved


def test_options_are_validated():
  with pytest.raises(ValueError, match=r"compression='int8' is unknown"):
    allreduce.AllReduceOptions(compression="int8")
  with pytest.raises(ValueError, match=r"clip_norm=0 must be > 0"):
    allreduce.AllReduceOptions(clip_norm=0)
