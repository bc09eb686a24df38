"""Parity: data-parallel training equals single-device training.

Same model, data, seed and optimizer (Adam); the only difference is how many
replicas share each global batch. The per-replica loss is scaled by the
global batch, so the all-reduced gradient equals the single-device one.
"""

import numpy as np
import pytest

import tfmgpu
from tfmgpu import models
from tfmgpu.training.loop import Trainer

STEPS = 6
BATCH = 32
DIGITS_ROWS = STEPS * BATCH  # For the `digits` fixture.


def train_weights(strategy, x, y, *, policy=None, steps_per_execution=1):
  with strategy.scope():
    model = models.build_model("convnet", input_shape=(28, 28, 1),
                               num_classes=10, seed=0, mixed_precision=policy)
  trainer = Trainer(model, strategy=strategy, learning_rate=1e-3,
                    steps_per_execution=steps_per_execution, verbose=0)
  result = trainer.fit(x, y, epochs=1, global_batch_size=BATCH,
                       steps_per_epoch=STEPS, seed=0)
  assert result.steps == STEPS
  return [w.copy() for w in model.get_weights()], result.history["loss"][0]


@pytest.fixture(scope="module")
def reference(dithered_digits):
  return train_weights(tfmgpu.get_strategy("one_device"), *dithered_digits)


# Each replica count and each steps_per_execution once (the mirrored step
# and the multi-step loop take the same path at 2 and 4 replicas).
@pytest.mark.parametrize("steps_per_execution,replicas", [(1, 2), (3, 4)])
def test_mirrored_equals_one_device(dithered_digits, reference, replicas,
                                    steps_per_execution):
  ref_weights, ref_loss = reference
  weights, loss = train_weights(
      tfmgpu.get_strategy("mirrored", num_replicas=replicas),
      *dithered_digits, steps_per_execution=steps_per_execution)
  moved = max(np.abs(w - w0).max() for w, w0 in zip(
      ref_weights, models.build_model("convnet", input_shape=(28, 28, 1),
                                      num_classes=10, seed=0).get_weights()))
  assert moved > 1e-3  # Training really changed the weights.
  for w, r in zip(weights, ref_weights):
    np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-5)
  assert loss == pytest.approx(ref_loss, rel=1e-5)


# bfloat16 keeps 8 bits of mantissa: activations differ by ~0.4% relative
# between reduction orders, and Adam turns a tiny gradient's changed sign into
# a full-size step. The stated tolerance: every weight within Adam's largest
# total move of one run (lr * steps = 6e-3; two runs stepping opposite ways
# could differ by twice that), and on average the weights differ by under 5%
# of how far training moved them. (Half the move held on the CPUs of earlier
# runs; on an AVX2 AMD EPYC one weight of 5,000 ended 3.3e-3 apart.)
BF16_MAX_ABS = 1e-3 * STEPS
BF16_MEAN_FRACTION = 0.05


def test_mixed_bfloat16_parity(digits):
  ref, _ = train_weights(tfmgpu.get_strategy("one_device"), *digits,
                         policy="mixed_bfloat16")
  got, _ = train_weights(tfmgpu.get_strategy("mirrored", num_replicas=2),
                         *digits, policy="mixed_bfloat16")
  init = models.build_model("convnet", input_shape=(28, 28, 1),
                            num_classes=10, seed=0).get_weights()
  diff = moved = 0.0
  for w, r, w0 in zip(got, ref, init):
    assert w.dtype == np.float32  # Variables stay float32.
    np.testing.assert_allclose(w, r, atol=BF16_MAX_ABS)
    diff += np.abs(w - r).sum()
    moved += np.abs(r - w0).sum()
  assert diff / moved < BF16_MEAN_FRACTION, diff / moved
