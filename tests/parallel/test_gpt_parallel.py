"""`gpt` tiny with a padding mask, split and pipelined: every placement trains
it to the unsplit weights, each stage's ops on its own device, and its plans
balance.

The padding mask is a model input read by every block's attention, so it
crosses every cut: the stages send it on with the activations.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.models import gpt
from tfmgpu.parallel import cost
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import inspection
from tfmgpu.parallel import partition
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import staged as staged_lib
from tfmgpu.training import loop

import test_cuts  # pylint: disable=g-bad-import-order  (its placement helpers)

T = 8
VOCAB = 32
BATCH = 8
STEPS = 3
MICRO = 2
SHAPE = {"tokens": (T,), "padding_mask": (T,)}
OPTIMIZERS = {"sgd": (lambda: keras.optimizers.SGD(0.1), 1e-5),
              "adam": (lambda: keras.optimizers.Adam(1e-3), 1e-4)}


def _gpt(seed=0):
  keras.utils.set_random_seed(seed)
  return gpt.gpt(SHAPE, VOCAB, size="tiny")


def _data(n=STEPS * BATCH):
  """Random tokens; each row real up to a length in [3, T], padded after."""
  rng = np.random.RandomState(5)
  tokens = rng.randint(0, VOCAB, size=(n, T)).astype("int32")
  lengths = rng.randint(3, T + 1, size=n)
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype("int32")
  assert 0 < mask.sum() < mask.size  # Some positions are padding.
  y = rng.randint(0, VOCAB, size=(n, T)).astype("int32")
  return {"tokens": tokens, "padding_mask": mask}, y


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _batches(x, y):
  for i in range(0, len(y), BATCH):
    yield {k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]


def _train(model, x, y, optimizer, split=None, **kwargs):
  """A custom loop: the split model's hook, or one tape on the unsplit
  model. Returns the losses and the traced step (its graph)."""
  loss_obj = _loss()
  if split is not None:
    split.build_optimizer(optimizer)
    variables = split.trainable_variables
  else:
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables

  @tf.function
  def step(xb, yb):
    if split is not None:
      loss, _, grads = split.compute_loss_and_gradients(xb, yb, loss_obj,
                                                        **kwargs)
    else:
      with tf.GradientTape() as tape:
        loss = loss_obj(yb, model(xb, training=True))
      grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))
    return loss

  losses = [float(step(xb, yb)) for xb, yb in _batches(x, y)]
  return losses, step.get_concrete_function(*next(_batches(x, y)))


@pytest.fixture(scope="module")
def data():
  return _data()


@pytest.fixture(scope="module")
def reference(data):
  """`{optimizer: (losses, weights)}` of unsplit training, and the initial
  weights."""
  out = {}
  for name, (make, _) in OPTIMIZERS.items():
    model = _gpt()
    out[name] = (_train(model, *data, make())[0], model.get_weights())
  return out, _gpt().get_weights()


def _assert_stage_ops_on_their_devices(split, concrete, pipelined):
  """Each stage's forward and backward ops (found by their name scopes) hold
  a matrix product and sit on the stage's device, read from the traced
  training step (`test_cuts`' helpers; attention's products are Einsum and
  BatchMatMulV2)."""
  by_stage = test_cuts._stage_ops(  # pylint: disable=protected-access
      inspection.op_placements(concrete), pipelined)
  for k, device in enumerate(split.stage_devices):
    for kind in ("forward", "backward"):
      ops = by_stage[(k, kind)]
      assert any(p.type in ("MatMul", "BatchMatMulV2", "Einsum")
                 for p in ops), (k, kind)
      bad = [(p.name, p.device) for p in ops if p.device != device and not (
          p.device == "" and (p.type in test_cuts.RESOURCE_OPS or
                              p.colocated))]
      assert bad == [], (k, kind)


def _assert_equal_training(got_losses, got_weights, reference, name):
  (want_losses, want_weights), initial = reference[0][name], reference[1]
  tol = OPTIMIZERS[name][1]
  np.testing.assert_allclose(got_losses, want_losses, rtol=tol)
  moved = max(np.abs(w - w0).max() for w, w0 in zip(want_weights, initial))
  assert moved > 10 * tol  # Training really moved the weights.
  assert len(got_weights) == len(want_weights)
  for i, (u, v) in enumerate(zip(got_weights, want_weights)):
    np.testing.assert_allclose(u, v, rtol=tol, atol=tol, err_msg=f"weight {i}")


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("num_stages,name", [(2, "sgd"), (4, "adam")])
def test_staged_gpt_trains_as_unsplit(data, reference, num_stages, name):
  split = staged_lib.StagedModel.from_model(_gpt(), num_stages=num_stages)
  assert len(set(split.stage_devices)) == num_stages
  stages = split.plan.stages
  for k, stage in enumerate(stages[:-1]):  # The mask crosses every cut
    later = [l for s in stages[k + 1:] for l in s.layers]  # before attention.
    if any(l.endswith("_attention") for l in later):
      assert {"padding_mask", "attention_mask"} & set(stage.sent), stage
  losses, step = _train(None, *data, OPTIMIZERS[name][0](), split=split)
  _assert_equal_training(losses, split.to_unsplit().get_weights(), reference,
                         name)
  _assert_stage_ops_on_their_devices(split, step, pipelined=False)


# Both schedules with and without recomputation, over 2 and 4 stages.
PIPELINES = [(2, "gpipe", True, "sgd"), (2, "1f1b", False, "sgd"),
             (4, "gpipe", False, "sgd"), (4, "1f1b", True, "adam")]


@pytest.mark.parametrize("num_stages,schedule,recompute,name", PIPELINES)
def test_pipelined_gpt_trains_as_unsplit(data, reference, num_stages,
                                         schedule, recompute, name):
  pipe = pipeline.PipelinedModel.from_model(
      _gpt(), num_stages=num_stages, micro_batches=MICRO, schedule=schedule,
      recompute=recompute)
  losses, step = _train(None, *data, OPTIMIZERS[name][0](), split=pipe,
                        loss_reduction="mean")
  _assert_equal_training(losses, pipe.to_unsplit().get_weights(), reference,
                         name)
  _assert_stage_ops_on_their_devices(pipe, step, pipelined=True)


def _trainer_weights(model, strategy, x, y):
  trainer = loop.Trainer(model, strategy=strategy, optimizer="sgd",
                         learning_rate=0.1, loss=_loss(), verbose=0)
  result = trainer.fit(x, y, epochs=1, global_batch_size=BATCH,
                       shuffle=False)
  assert result.steps == STEPS
  unsplit = getattr(model, "to_unsplit", lambda: model)()
  return result.history["loss"], unsplit.get_weights()


def test_trainer_mirrored_and_pipelined_gpt_equal_one_device(data, reference):
  """The one-device side is `reference`'s SGD(0.1) unsplit loop (the same
  weights as a one-device Trainer's, whose epoch loss is its steps' mean);
  the one-device Trainer itself is `tests/training`'s."""
  x, y = data
  (want_losses, want_weights), initial = reference[0]["sgd"], reference[1]
  assert max(np.abs(w - w0).max() for w, w0 in zip(want_weights, initial)) \
      > 1e-4  # Training really moved the weights.
  mirrored = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with mirrored.scope():
    model = _gpt()
  runs = {"mirrored x2": _trainer_weights(model, mirrored, x, y),
          "pipeline": _trainer_weights(
              pipeline.PipelinedModel.from_model(
                  _gpt(), num_stages=2, micro_batches=MICRO,
                  schedule="1f1b"),
              tf.distribute.get_strategy(), x, y)}
  for what, (losses, weights) in runs.items():
    np.testing.assert_allclose(losses, [np.mean(want_losses)], rtol=1e-5,
                               err_msg=what)
    assert len(weights) == len(want_weights), what
    for i, (u, v) in enumerate(zip(weights, want_weights)):
      np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{what}: weight {i}")


# -------------------------------------------------------------------- plans


def _max_over_ideal(model, num_stages):
  """The plan's most expensive stage (blocks and the cuts it sends and
  receives) over the ideal split: the total block cost / `num_stages`."""
  graph = graph_lib.ModelGraph(model)
  blocks = cost.model_blocks(graph)
  costs = cost.block_costs(blocks, cost.Criterion.BALANCED)
  edge = [0.0] + cost.cut_costs(blocks, costs, cost.cut_bytes(graph)) + [0.0]
  plan = partition.plan_stages(model, num_stages,
                               devices=["/cpu:0"] * num_stages)
  starts = [graph.position(s.layers[0]) for s in plan.stages] + [len(blocks)]
  worst = max(sum(costs[a:b]) + edge[a] + edge[b]
              for a, b in zip(starts, starts[1:]))
  return worst / (sum(costs) / num_stages)


def test_an_8_block_gpt_splits_within_10_percent_of_ideal():
  """GPT-2 small's structure with 8 blocks (d_model 256, T 128): 2, 4 and 8
  stages each within 10% of the total cost / K (any layer may start a
  stage; measured 1.004, 1.025, 1.067)."""
  model = graph_lib.shapes_only(lambda: gpt.gpt(
      {"tokens": (128,), "padding_mask": (128,)}, 256, size="tiny",
      num_layers=8, d_model=256, num_heads=4))
  ratios = [_max_over_ideal(model, k) for k in (2, 4, 8)]
  assert all(1.0 <= r <= 1.10 for r in ratios), ratios


def test_gpt2_small_at_its_context_splits_into_8_within_10_percent():
  """The acceptance plan (`--model_size=gpt2_small --num_stages=8
  --plan_only` reads 1,024-byte windows): measured 1.04-1.08."""
  model = graph_lib.shapes_only(lambda: gpt.gpt(
      (gpt.CONTEXTS["gpt2_small"],), 256, size="gpt2_small"))
  assert 1.0 <= _max_over_ideal(model, 8) <= 1.10
