"""Keras Applications (ResNet50, MobileNetV2, EfficientNetB0; random weights,
small images) as registry models: balanced plans for 2, 4 and 8 stages, the
plan printed by `--plan_only`, and ResNet50 split in two training as unsplit.
"""

import re

from absl.testing import flagsaver
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import models
from tfmgpu import train
from tfmgpu.parallel import cost
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import partition
from tfmgpu.parallel import staged as staged_lib

APPLICATIONS = ("resnet50", "mobilenet_v2", "efficientnet_b0")
IMAGE = (32, 32, 3)
CLASSES = 5
BATCH = 4
STEPS = 2


def _shapes_only(name, input_shape=IMAGE):
  """The model's layers and weight shapes, no weight values (fast)."""
  return graph_lib.shapes_only(lambda: models.build_model(
      name, input_shape=input_shape, num_classes=CLASSES))


@pytest.fixture(scope="module")
def resnet50():
  """One real ResNet50 (random weights), shared by the module."""
  return models.build_model("resnet50", input_shape=IMAGE,
                            num_classes=CLASSES, seed=0)


@pytest.mark.parametrize("name", APPLICATIONS)
def test_plans_for_2_4_8_stages_are_balanced(cpu_devices, name):
  model = _shapes_only(name)
  graph = graph_lib.ModelGraph(model)
  blocks = cost.model_blocks(graph)
  costs = cost.block_costs(blocks, cost.Criterion.BALANCED)
  cuts = cost.cut_costs(blocks, costs, cost.cut_bytes(graph))
  edge = [0.0] + cuts + [0.0]
  for k in (2, 4, 8):
    plan = partition.plan_stages(model, k, devices=(cpu_devices * 2)[:k])
    assert plan.num_stages == k
    assert plan.layer_names == tuple(graph.names)
    starts = [graph.position(s.layers[0]) for s in plan.stages]
    worst = max(sum(costs[a:b]) + edge[a] + edge[b]
                for a, b in zip(starts, starts[1:] + [len(blocks)]))
    ideal = sum(costs) / k
    # A contiguous split within one block (and its two cuts) of the ideal
    # always exists; the exact optimum is no worse. Measured: at most 1.16.
    assert worst <= ideal + max(costs) + 2 * max(cuts)
    assert worst <= 1.2 * ideal, (name, k, worst / ideal)
    for s, end in zip(plan.stages, starts[1:]):
      assert s.sent == tuple(graph.name_of(t) for t in graph.crossing(end))


def test_residual_cuts_send_the_skip_tensor_with_the_activation(cpu_devices):
  """A cut inside a bottleneck block sends its shortcut as well."""
  model = _shapes_only("resnet50")
  plan = partition.plan_stages(model, 2, split_points=["conv3_block2_2_conv"],
                               devices=cpu_devices[:2])
  assert plan.stages[0].sent == ("conv3_block1_out", "conv3_block2_1_relu")


def test_small_images_are_padded_and_other_shapes_refused():
  model = _shapes_only("mobilenet_v2", (28, 28, 1))
  assert model.layers[1].name == "pad_to_min_size"
  assert model.layers[1].output.shape == (None, 32, 32, 1)
  assert model.output_shape == (None, CLASSES)
  assert model.output.dtype == "float32"
  assert "pad_to_min_size" not in [l.name for l in _shapes_only(
      "efficientnet_b0").layers]
  with pytest.raises(ValueError, match=r"model 'resnet50' takes images: "
                     r"input_shape=\(height, width, channels\)"):
    models.build_model("resnet50", input_shape=(64,), num_classes=CLASSES)


@pytest.mark.usefixtures("parsed_flags")
def test_plan_only_prints_resnet50_plans(capsys):
  for k in (2, 4, 8):
    with flagsaver.flagsaver(strategy="pipeline", model="resnet50",
                             num_stages=k, micro_batches=4, plan_only=True):
      assert train.main(["train"]) == 0
    out = capsys.readouterr().out
    assert f"StagePlan for 'resnet50': {k} stage(s)" in out
    assert len(re.findall(r"^\d\s+/device:CPU:\d", out, re.M)) == k
    assert "pad_to_min_size" in out  # The digits are 28x28, padded.
    assert re.search(r"^max\s+[\d.]+ MiB$", out, re.M)
  assert "(A plan for 8 devices; this machine has 4.)" in out


def _train(model, x, y, split=None):
  """SGD steps, eagerly (tracing ResNet50 twice would cost ten times more);
  one tape on the unsplit model, or the split's hook."""
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  optimizer = keras.optimizers.SGD(0.05)
  variables = (split or model).trainable_variables
  if split is not None:
    split.build_optimizer(optimizer)
  else:
    optimizer.build(variables)

  def step(xb, yb):
    if split is not None:
      loss, _, grads = split.compute_loss_and_gradients(xb, yb, loss_fn)
    else:
      with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
      grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))
    return loss

  return [float(step(x[i:i + BATCH], y[i:i + BATCH]))
          for i in range(0, len(x), BATCH)]


def test_resnet50_split_in_two_trains_as_unsplit(resnet50):
  rng = np.random.RandomState(0)
  x = rng.rand(STEPS * BATCH, *IMAGE).astype("float32")
  y = rng.randint(0, CLASSES, STEPS * BATCH)
  initial = resnet50.get_weights()
  split = staged_lib.StagedModel.from_model(resnet50, num_stages=2)
  assert len(split.plan.stages[0].sent) >= 1
  got = _train(None, x, y, split=split)
  want = _train(resnet50, x, y)  # BatchNorm in training mode in both.
  np.testing.assert_allclose(got, want, rtol=1e-5)
  weights = split.to_unsplit().get_weights()
  moved = max(np.abs(w - w0).max() for w, w0 in zip(resnet50.get_weights(),
                                                     initial))
  assert moved > 1e-3
  for i, (u, v) in enumerate(zip(weights, resnet50.get_weights())):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5,
                               err_msg=f"weight {i}")
