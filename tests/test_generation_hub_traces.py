"""A placed keras_hub causal LM traces its decode loop once per sampler:
asking again, or for other prompts of the same shape, reuses it."""

import numpy as np
import pytest

import tfmgpu
from tfmgpu import generation
from tfmgpu import models
from tfmgpu.parallel import hybrid

pytest.importorskip("keras_hub")


@pytest.mark.parametrize("layout", [hybrid.Layout(stages=2, tensor=2)])
def test_a_placed_llama_traces_its_decode_loop_once(layout):
  wrapper = models.build_model("llama", input_shape=(16,), num_classes=64,
                               size="tiny", seed=0)
  placed = hybrid.build_layout(
      wrapper, layout, devices=tfmgpu.list_devices("CPU")[:layout.num_devices])
  generator = generation.Generator(placed)
  rng = np.random.RandomState(0)
  for _ in range(2):
    ids = rng.randint(1, 64, (2, 4)).astype(np.int32)
    generator.generate(ids, max_new_tokens=6)
  assert generator.traces == 1
  generator.generate(ids, max_new_tokens=6,
                     sampling=generation.Sampling("top_k", k=3, seed=1))
  assert generator.traces == 2
