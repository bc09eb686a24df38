"""Any cut of a functional graph: stage boundaries that carry several tensors
(activations, skip tensors, model inputs read later), and models with
several inputs, split, pipelined and trained through the Trainer."""

import collections
import itertools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.parallel import cost
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import inspection
from tfmgpu.parallel import partition
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import staged as staged_lib
from tfmgpu.training import loop

L = keras.layers
LR = 0.05
BATCH = 16
ROWS = 3 * BATCH
RESOURCE_OPS = {"Placeholder", "ReadVariableOp", "VarHandleOp"}


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _three_tensor_model(seed=0):
  """Cut before `d2`: ids (a model input), d0 (a skip tensor) and d1 (the
  activation) cross; before `embed`: ids, d0 and d2, ids and d0 skipping
  the middle stage."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((6,), name="x")
  ids = keras.Input((2,), dtype="int32", name="ids")
  h0 = L.Dense(8, activation="tanh", name="d0")(x)
  h1 = L.Dense(8, activation="tanh", name="d1")(h0)
  h2 = L.Dense(8, activation="tanh", name="d2")(h1)
  s = L.Add(name="res")([h0, h2])
  e = L.Flatten(name="flat")(L.Embedding(5, 2, name="embed")(ids))
  out = L.Dense(3, name="logits")(L.Concatenate(name="join")([s, e]))
  return keras.Model({"x": x, "ids": ids}, out, name="three")


def _three_tensor_data(n=BATCH):
  rng = np.random.RandomState(2)
  return ({"x": rng.randn(n, 6).astype("float32"),
           "ids": rng.randint(0, 5, size=(n, 2)).astype("int32")},
          rng.randint(0, 3, size=(n,)).astype("int64"))


def _two_input_model(seed=0):
  """image + tabular, dict-fed; the tabular input joins at the end."""
  keras.utils.set_random_seed(seed)
  image = keras.Input((6, 6, 1), name="image")
  tab = keras.Input((5,), name="tab")
  h = L.Conv2D(3, 3, activation="relu", name="conv")(image)
  h = L.Dense(8, activation="tanh", name="d1")(L.Flatten(name="flat")(h))
  h2 = L.Dense(8, activation="tanh", name="d2")(h)
  h = L.Add(name="res")([h, h2])
  t = L.Dense(4, activation="tanh", name="tab_dense")(tab)
  out = L.Dense(2, name="logits")(L.Concatenate(name="join")([h, t]))
  return keras.Model({"image": image, "tab": tab}, out, name="two_input")


def _two_input_data(n=ROWS):
  rng = np.random.RandomState(3)
  image = rng.randn(n, 6, 6, 1).astype("float32")
  tab = rng.randn(n, 5).astype("float32")
  y = ((image.mean(axis=(1, 2, 3)) + tab[:, 0]) > 0).astype("int64")
  return {"image": image, "tab": tab}, y


def _assert_same_weights(a, b, tol=1e-5):
  wa, wb = a.get_weights(), b.get_weights()
  assert len(wa) == len(wb)
  for i, (u, v) in enumerate(zip(wa, wb)):
    np.testing.assert_allclose(u, v, rtol=tol, atol=tol, err_msg=f"weight {i}")


def _assert_fits_as_keras(split, model, x, y, loss=None):
  """Keras `fit` of the placed `split` and of the unsplit `model` (same
  initial weights): equal losses, and equal weights afterwards."""
  for m in (split, model):
    m.compile(optimizer=keras.optimizers.SGD(LR), loss=loss or _loss())
  got = split.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  want = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  _assert_same_weights(split.to_unsplit(), model)


# -------------------------------------------------- a cut of three tensors


def test_a_cut_carries_activation_skip_tensor_and_model_input():
  model = _three_tensor_model()
  plan = partition.plan_stages(model, 3, split_points=["d2", "embed"])
  first, middle, last = plan.stages
  assert [s.layers for s in plan.stages] == [
      ("d0", "d1"), ("d2",), ("embed", "res", "flat", "join", "logits")]
  assert first.sent == ("ids", "d0", "d1")
  assert middle.sent == ("ids", "d0", "d2")  # ids and d0 skip the stage.
  assert last.sent == ()
  assert first.input_bytes == 6 * 4 + 2 * 4
  assert first.sent_bytes == 2 * 4 + 8 * 4 + 8 * 4 == middle.input_bytes
  assert middle.sent_bytes == last.input_bytes == 72
  assert "3: ids, d0, d1" in plan.table()

  staged = staged_lib.StagedModel(model, plan)
  sub = staged.stages[1]
  assert len(sub.inputs) == 3 and len(sub.outputs) == 3
  assert [t.dtype for t in sub.inputs] == ["int32", "float32", "float32"]
  assert sub.layers[-1].name == "d2" and len(sub.layers) == 4  # 3 inputs.


def test_three_tensor_cut_gives_the_unsplit_forward_and_gradients():
  model = _three_tensor_model()
  x, y = _three_tensor_data()
  staged = staged_lib.StagedModel.from_model(
      model, split_points=["d2", "embed"], num_stages=3)
  loss, y_pred, grads = staged.compute_loss_and_gradients(x, y, _loss())
  with tf.GradientTape() as tape:
    want_pred = model(x, training=True)
    want_loss = _loss()(y, want_pred)
  np.testing.assert_allclose(y_pred, want_pred, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  key = lambda v: "/".join(v.path.split("/")[-2:])
  want = dict(zip([key(v) for v in model.trainable_variables],
                  tape.gradient(want_loss, model.trainable_variables)))
  assert sorted(key(v) for v in staged.trainable_variables) == sorted(want)
  for v, g in zip(staged.trainable_variables, grads):
    dense = tf.convert_to_tensor  # The embedding's gradients are sparse.
    np.testing.assert_allclose(dense(g), dense(want[key(v)]), rtol=1e-5,
                               atol=1e-6, err_msg=v.path)


_STAGE = re.compile(r"^(?:gradient_tape/)?stage_(\d+)(_backward)?(?:_mb_\d+)?"
                    r"(?:_\d+)?/")
_PIPE = re.compile(r"^(gradient_tape/)?stage_(\d+)_(mb|backward_mb|"
                   r"recompute_mb)_\d+/")


def _stage_ops(placements, pipelined):
  """{(stage, "forward" | "backward"): [OpPlacement]}, from name scopes."""
  out = collections.defaultdict(list)
  for p in placements:
    m = (_PIPE if pipelined else _STAGE).match(p.name)
    if not m:
      continue
    if pipelined:
      k, backward = int(m.group(2)), bool(m.group(1)) or m.group(3) != "mb"
    else:
      k = int(m.group(1))
      backward = bool(m.group(2)) or p.name.startswith("gradient_tape/")
    out[(k, "backward" if backward else "forward")].append(p)
  return out


def _assert_stage_ops_on_their_devices(model, concrete, pipelined):
  by_stage = _stage_ops(inspection.op_placements(concrete), pipelined)
  for k, device in enumerate(model.stage_devices):
    for kind in ("forward", "backward"):
      ops = by_stage[(k, kind)]
      assert any(p.type in ("MatMul", "Conv2D", "Conv2DBackpropFilter")
                 for p in ops), (k, kind)
      # Ops with no device of their own: variable handles and reads, and
      # ops TF pins next to a variable (an embedding gradient's shape).
      bad = [(p.name, p.device) for p in ops if p.device != device and not (
          p.device == "" and (p.type in RESOURCE_OPS or p.colocated))]
      assert bad == [], (k, kind)


def _traced_step(model, x, y, **kwargs):
  optimizer = model.build_optimizer(keras.optimizers.SGD(LR))

  def step(xb, yb):
    loss, _, grads = model.compute_loss_and_gradients(xb, yb, _loss(),
                                                      **kwargs)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  spec = lambda a: tf.TensorSpec(a.shape, a.dtype)
  return tf.function(step).get_concrete_function(
      tf.nest.map_structure(spec, x), spec(y))


def test_three_tensor_stages_run_forward_and_backward_on_their_devices(
    cpu_devices):
  model = _three_tensor_model()
  x, y = _three_tensor_data()
  staged = staged_lib.StagedModel.from_model(
      model, num_stages=3, split_points=["d2", "embed"],
      devices=cpu_devices[1:])
  _assert_stage_ops_on_their_devices(staged, _traced_step(staged, x, y),
                                     pipelined=False)


# ------------------------------------------ two inputs, through the Trainer


def _trainer_fit(model, x, y):
  trainer = loop.Trainer(model, strategy=tf.distribute.get_strategy(),
                         optimizer="sgd", learning_rate=LR, loss=_loss(),
                         verbose=0)
  result = trainer.fit(x, y, epochs=1, global_batch_size=BATCH,
                       shuffle=False)
  assert result.steps == ROWS // BATCH
  return result.history["loss"]


@pytest.fixture(scope="module")
def unsplit():
  """Losses and final weights of the unsplit two-input model, trained by the
  Trainer on one device."""
  model = _two_input_model()
  x, y = _two_input_data()
  return _trainer_fit(model, x, y), model


def _naive_crossing(graph, position):
  """Tensors made before `position` (or model inputs) and read at or after
  it (or model outputs), found from the nodes alone."""
  made = {id(t) for t in graph.inputs}
  for node in graph.nodes[:position]:
    made.update(id(t) for t in node.output_tensors)
  read = {id(t) for t in graph.outputs}
  for node in graph.nodes[position:]:
    read.update(id(t) for t in node.input_tensors)
  return made & read


@pytest.mark.parametrize("build", [_three_tensor_model, _two_input_model])
def test_plans_are_optimal_over_every_multi_tensor_split(build):
  """Brute force over every split of real graphs: the cut bytes are what
  crosses, and no split has a cheaper most expensive stage."""
  model = build()
  graph = graph_lib.ModelGraph(model)
  blocks = cost.model_blocks(graph)
  n = len(blocks)
  crossing = cost.cut_bytes(graph)
  for p in range(1, n):
    naive = _naive_crossing(graph, p)
    assert {id(t) for t in graph.crossing(p)} == naive
    assert crossing[p] == sum(graph_lib.tensor_bytes(t)
                              for t in graph.tensors() if id(t) in naive)
  assert max(len(_naive_crossing(graph, p)) for p in range(1, n)) >= 3
  costs = cost.block_costs(blocks, cost.Criterion.BALANCED)
  edge = [0.0] + cost.cut_costs(blocks, costs, crossing) + [0.0]
  worst = lambda b: max(sum(costs[i:j]) + edge[i] + edge[j]
                        for i, j in zip(b, b[1:]))
  for k in (2, 3, 4):
    plan = partition.plan_stages(model, k)
    starts = [graph.position(s.layers[0]) for s in plan.stages]
    best = min(worst((0,) + cuts + (n,))
               for cuts in itertools.combinations(range(1, n), k - 1))
    assert worst(tuple(starts) + (n,)) == pytest.approx(best, rel=1e-12)
    for s, end in zip(plan.stages, starts[1:]):
      assert s.sent_bytes == crossing[end]


def test_two_input_plans_send_the_late_input_with_the_activations():
  for k in (2, 3):
    plan = partition.plan_stages(_two_input_model(), k)
    assert all("tab" in s.sent for s in plan.stages[:-1]), plan.table()
    assert all(len(s.sent) >= 2 for s in plan.stages[:-1]), plan.table()


# Every schedule and recomputation on K=3, where the late input crosses
# both cuts (a superset of K=2's one cut); K=2 once, split.
@pytest.mark.parametrize("num_stages,options", [(2, None)] + [
    (3, o) for o in [None] + [
        dict(schedule=name, recompute=r) for name in ("gpipe", "1f1b")
        for r in (False, True)]])
def test_two_input_model_split_trains_as_unsplit(unsplit, num_stages,
                                                 options):
  want_losses, want = unsplit
  x, y = _two_input_data()
  if options is None:
    split = staged_lib.StagedModel.from_model(_two_input_model(),
                                              num_stages=num_stages)
  else:
    split = pipeline.PipelinedModel.from_model(
        _two_input_model(), num_stages=num_stages, micro_batches=4, **options)
  assert split.plan.num_stages == num_stages
  got_losses = _trainer_fit(split, x, y)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  _assert_same_weights(split.to_unsplit(), want)


@pytest.mark.parametrize("name,recompute", [("gpipe", False),
                                            ("1f1b", True)])
def test_two_input_pipeline_ops_run_on_their_devices(cpu_devices, name,
                                                     recompute):
  x, y = _two_input_data(BATCH)
  pipe = pipeline.PipelinedModel.from_model(
      _two_input_model(), num_stages=3, devices=cpu_devices[1:],
      micro_batches=4, schedule=name, recompute=recompute)
  _assert_stage_ops_on_their_devices(
      pipe, _traced_step(pipe, x, y, loss_reduction="mean"), pipelined=True)


def test_two_input_staged_fit_matches_keras_fit():
  model = _two_input_model()
  x, y = _two_input_data()
  split = staged_lib.StagedModel.from_model(model, num_stages=3)
  _assert_fits_as_keras(split, model, x, y)


def test_two_input_pipeline_predicts_a_ragged_dict_batch():
  model = _two_input_model()
  x, _ = _two_input_data(13)
  pipe = pipeline.PipelinedModel.from_model(model, num_stages=3,
                                            micro_batches=4)
  np.testing.assert_allclose(pipe.predict(x, batch_size=8, verbose=0),
                             model.predict(x, batch_size=8, verbose=0),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", [None, "1f1b"])
def test_a_loss_dict_for_list_outputs_fits_as_keras_fits(schedule):
  """Keras keys a loss dict by `model.output_names`, which a placed model
  takes from the unsplit one (without them `fit` failed on a None)."""
  def build():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    h = L.Dense(8, activation="tanh", name="d0")(x)
    h = L.Dense(8, activation="tanh", name="d1")(h)
    return keras.Model(x, [L.Dense(3, name="cls")(h),
                           L.Dense(1, name="val")(h)])
  rng = np.random.RandomState(5)
  x = rng.randn(2 * BATCH, 6).astype("float32")
  y = {"cls": rng.randint(0, 3, 2 * BATCH),
       "val": rng.randn(2 * BATCH, 1).astype("float32")}
  model = build()
  split = (staged_lib.StagedModel.from_model(build(), num_stages=2)
           if schedule is None else pipeline.PipelinedModel.from_model(
               build(), num_stages=2, micro_batches=4, schedule=schedule))
  _assert_fits_as_keras(split, model, x, y,
                        loss={"val": "mse", "cls": _loss()})


def _two_output_model(seed=0):
  """An auxiliary head made in the first stage, a main head at the end."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((6,), name="x")
  h0 = L.Dense(8, activation="tanh", name="d0")(x)
  aux = L.Dense(2, name="aux")(h0)
  h1 = L.Dense(8, activation="tanh", name="d1")(
      L.Concatenate(name="cat")([h0, aux]))
  main = L.Dense(3, name="main")(L.Dense(8, activation="tanh", name="d2")(h1))
  return keras.Model(x, {"main": main, "aux": aux}, name="two_output")


@pytest.mark.parametrize("options", [
    None, dict(schedule="gpipe", recompute=False),
    dict(schedule="1f1b", recompute=True)])
def test_an_output_made_early_travels_to_the_end(options):
  model = _two_output_model()
  rng = np.random.RandomState(4)
  x = rng.randn(BATCH, 6).astype("float32")
  y = {"main": rng.randint(0, 3, BATCH), "aux": rng.randint(0, 2, BATCH)}
  loss_fn = lambda t, p: _loss()(t["main"], p["main"]) + _loss()(t["aux"],
                                                                   p["aux"])
  plan = partition.plan_stages(model, 3, split_points=["d1", "d2"])
  assert plan.stages[0].sent == ("aux", "cat")
  assert plan.stages[1].sent == ("aux", "d1")  # aux skips stage 1.
  if options is None:
    split, kwargs = staged_lib.StagedModel(_two_output_model(), plan), {}
  else:
    split = pipeline.PipelinedModel(_two_output_model(), plan,
                                    micro_batches=4, **options)
    kwargs = dict(loss_reduction="mean")
  loss, y_pred, grads = split.compute_loss_and_gradients(x, y, loss_fn,
                                                         **kwargs)
  with tf.GradientTape() as tape:
    want_pred = model(x, training=True)
    want_loss = loss_fn(y, want_pred)
  want = tape.gradient(want_loss, model.trainable_variables)
  assert set(y_pred) == {"main", "aux"}
  for name in ("main", "aux"):
    np.testing.assert_allclose(y_pred[name], want_pred[name], rtol=1e-5,
                               atol=1e-6)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  key = lambda v: "/".join(v.path.split("/")[-2:])
  by_key = dict(zip([key(v) for v in model.trainable_variables], want))
  for v, g in zip(split.trainable_variables, grads):
    np.testing.assert_allclose(g, by_key[key(v)], rtol=1e-5, atol=1e-6,
                               err_msg=v.path)


def _dict_output_model(seed=0):
  """Dict outputs keyed unlike the layers that make them (as keras_hub's
  `BertBackbone` returns `pooled_output` from its `pooled_dense`)."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((6,), name="x")
  h = L.Dense(8, activation="tanh", name="d0")(x)
  h = L.Dense(8, activation="tanh", name="d1")(h)
  return keras.Model(x, {"cls_out": L.Dense(3, name="cls")(h),
                         "val_out": L.Dense(1, name="val")(h)})


@pytest.mark.parametrize("schedule", [None, "gpipe", "1f1b"])
def test_a_loss_dict_by_output_key_trains_as_one_device(schedule):
  """Placed models keep the unsplit model's dict keys as output names: the
  Trainer's loss dict by key once failed ("not outputs of the model; its
  outputs are ['cls', 'val']"), and Keras fit matches too."""
  rng = np.random.RandomState(5)
  x = rng.randn(2 * BATCH, 6).astype("float32")
  y = {"cls_out": rng.randint(0, 3, 2 * BATCH),
       "val_out": rng.randn(2 * BATCH, 1).astype("float32")}
  loss = {"val_out": "mse", "cls_out": _loss()}
  split = (staged_lib.StagedModel.from_model(_dict_output_model(),
                                             num_stages=2)
           if schedule is None else pipeline.PipelinedModel.from_model(
               _dict_output_model(), num_stages=2, micro_batches=2,
               schedule=schedule))
  assert split.unsplit_output_names == ("cls_out", "val_out")
  histories, models = [], []
  for model in (split, _dict_output_model()):
    trainer = loop.Trainer(model, strategy=tf.distribute.get_strategy(),
                           optimizer="sgd", learning_rate=LR, loss=loss,
                           metrics=[], verbose=0)
    histories.append(trainer.fit(x, y, epochs=1, global_batch_size=BATCH,
                                 shuffle=False).history)
    models.append(model)
  for key in ("loss", "cls_out_loss", "val_out_loss"):
    np.testing.assert_allclose(histories[0][key], histories[1][key],
                               rtol=1e-5)
  _assert_same_weights(split.to_unsplit(), models[1])
  np.testing.assert_allclose(split.predict(x, verbose=0)["val_out"],
                             models[1].predict(x, verbose=0)["val_out"],
                             rtol=1e-5, atol=1e-6)


# ------------------------------------- functional models made of sub-models


def _nested_model(seed=0):
  """An encoder (a functional model) of two residual blocks (each one too),
  the second block reading an extra model input `e` as well."""
  keras.utils.set_random_seed(seed)
  def block(i):
    x, e = keras.Input((8,)), keras.Input((2,))
    h = L.Dense(8, activation="tanh", name=f"b{i}_d0")(
        L.Concatenate(name=f"b{i}_cat")([x, e]))
    h = L.Dense(8, name=f"b{i}_d1")(h)
    return keras.Model([x, e], L.Add(name=f"b{i}_add")([x, h]),
                       name=f"block{i}")
  x, e = keras.Input((6,)), keras.Input((2,))
  h = L.Dense(8, name="stem")(x)
  h = block(1)([block(0)([h, e]), e])
  encoder = keras.Model([x, e], h, name="encoder")
  x, e = keras.Input((6,), name="x"), keras.Input((2,), name="e")
  out = L.Dense(3, name="logits")(encoder([x, e]))
  return keras.Model({"x": x, "e": e}, out, name="nested")


@pytest.mark.parametrize("schedule", [None, "gpipe", "1f1b"])
def test_nested_functional_models_are_cut_between_their_blocks(schedule):
  """Planning and placing look inside nested functional models (before,
  the encoder was one layer and could not be split); the extra input
  crosses the cut as a top-level one does."""
  model = _nested_model()
  graph = graph_lib.ModelGraph(model)
  assert set(graph.inlined) == {"encoder", "block0", "block1"}
  assert graph.names == ["stem", "b0_cat", "b0_d0", "b0_d1", "b0_add",
                         "b1_cat", "b1_d0", "b1_d1", "b1_add", "logits"]
  plan = partition.plan_stages(model, 2, split_points=["b1_cat"])
  assert plan.stages[0].sent == ("e", "b0_add")
  rng = np.random.RandomState(3)
  x = {"x": rng.randn(2 * BATCH, 6).astype("float32"),
       "e": rng.randn(2 * BATCH, 2).astype("float32")}
  y = rng.randint(0, 3, 2 * BATCH)
  split = (staged_lib.StagedModel(_nested_model(), plan) if schedule is None
           else pipeline.PipelinedModel(_nested_model(), plan,
                                        micro_batches=2, schedule=schedule))
  np.testing.assert_allclose(split.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-5,
                             atol=1e-6)
  _assert_fits_as_keras(split, model, x, y)
  copy = _nested_model(seed=1)
  split.copy_weights_to(copy)
  _assert_same_weights(copy, model)


def test_a_nested_model_whose_layer_is_used_outside_it_is_inlined():
  """As a keras_hub CausalLM calls its backbone's token embedding again as
  its head: the nested model is cut too, and each call of the shared layer
  is a node of its own (`embed`, then `embed.2`); on one stage, its
  weights count once."""
  ids = keras.Input((4,), dtype="int32")
  embed = L.Embedding(10, 8, name="embed")
  inner = keras.Model(ids, L.Dense(8, name="mix")(embed(ids)), name="inner")
  ids = keras.Input((4,), dtype="int32", name="ids")
  out = L.Add(name="sum")([inner(ids), embed(ids)])
  graph = graph_lib.ModelGraph(keras.Model(ids, out))
  assert graph.inlined == ("inner",)
  assert sorted(graph.names) == ["embed", "embed.2", "mix", "sum"]
  assert graph.layers()["embed.2"] is embed
  plan = partition.plan_stages(graph.model, 1)
  assert plan.stages[0].param_bytes == (10 * 8 + 8 * 8 + 8) * 4


def test_a_keras_hub_classifier_is_cut_inside_its_backbone():
  """BertTextClassifier nests its backbone as one layer: the plan now cuts
  between its transformer blocks, the padding mask crosses, and the split
  predicts as the model does. A GPT2CausalLM, whose LM head reuses the
  backbone's token embedding, is cut between its blocks too."""
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(0)
  tiny = dict(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
              intermediate_dim=32, max_sequence_length=16)
  model = keras_hub.models.BertTextClassifier(
      backbone=keras_hub.models.BertBackbone(**tiny), num_classes=3,
      preprocessor=None)
  plan = partition.plan_stages(model, 2, split_points=["transformer_layer_1"])
  assert "transformer_layer_0" in plan.stages[0].layers
  assert "padding_mask" in plan.stages[0].sent
  rng = np.random.RandomState(0)
  x = {"token_ids": rng.randint(0, 64, (4, 16)).astype("int32"),
       "segment_ids": np.zeros((4, 16), "int32"),
       "padding_mask": np.ones((4, 16), "int32")}
  split = staged_lib.StagedModel(model, plan)
  np.testing.assert_allclose(split.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-5,
                             atol=1e-6)
  lm = keras_hub.models.GPT2CausalLM(
      backbone=keras_hub.models.GPT2Backbone(**tiny), preprocessor=None)
  assert graph_lib.ModelGraph(lm).names == [
      "token_embedding", "position_embedding", "embeddings_add",
      "embeddings_dropout", "transformer_layer_0", "transformer_layer_1",
      "layer_norm", "token_embedding.2"]
