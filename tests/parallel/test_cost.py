"""The cost model: FLOPs, parameter and activation bytes per block."""

import keras

from tfmgpu.models import demo
from tfmgpu.parallel import cost
from tfmgpu.parallel import partition

plan_stages = partition.plan_stages


def test_costs_count_dense_and_conv_flops_params_and_activations():
  L = keras.layers
  inputs = keras.Input((6, 6, 2))
  x = L.Conv2D(4, 3, padding="valid", activation="relu", name="conv")(inputs)
  x = L.Flatten(name="flat")(x)
  outputs = L.Dense(5, name="dense")(x)
  blocks = cost.model_blocks(keras.Model(inputs, outputs))
  conv, flat, dense = blocks
  # Conv: 4x4 outputs x 4 filters x (3*3*2 MACs x 2) + bias + ReLU.
  assert conv.flops == 16 * 4 * 3 * 3 * 2 * 2 + 64 + 64
  assert conv.param_bytes == (3 * 3 * 2 * 4 + 4) * 4
  assert conv.output_bytes == 4 * 4 * 4 * 4 and conv.output_shape == (
      None, 4, 4, 4)
  assert flat.flops == 0 and flat.param_bytes == 0
  assert dense.flops == 2 * 64 * 5 + 5
  assert dense.param_bytes == (64 * 5 + 5) * 4


def test_residual_blocks_are_cut_only_between_blocks():
  model = demo.small_resnet((8, 8, 3), 4, blocks=3, filters=4)
  blocks = cost.model_blocks(model)
  starts = [b.layers[0] for b in blocks]
  assert "block1_conv1" in starts and "block1_conv2" not in starts
  assert "block1_bn1" not in starts and "block2_proj" not in starts
  block1 = next(b for b in blocks if b.layers[0] == "block1_conv1")
  assert block1.layers == ("block1_conv1", "block1_bn1", "block1_relu1",
                           "block1_conv2", "block1_bn2", "block1_add")
  block2 = next(b for b in blocks if b.layers[0] == "block2_conv1")
  assert "block2_proj" in block2.layers  # The projection shortcut is inside.
  plan = plan_stages(model, 3, criterion="flops")
  for stage in plan.stages[1:]:
    assert stage.layers[0] in starts
  assert plan.layer_names == tuple(l.name for l in model.layers[1:])
