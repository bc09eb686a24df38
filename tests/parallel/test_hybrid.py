"""Hybrid layouts of `gpt` tiny: data x pipeline, data x tensor, pipeline x
tensor and all three, each trained equal to the unsplit model, each part's
ops on the devices the layout names, and weights that move between layouts.
"""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.parallel import hybrid
from tfmgpu.parallel import inspection
from tfmgpu.parallel import replicated
from tfmgpu.training import allreduce

import test_gpt_parallel as gp  # pylint: disable=g-bad-import-order

RESOURCE_OPS = {"Placeholder", "ReadVariableOp", "VarHandleOp", "NoOp",
                "Identity"}


@pytest.fixture(scope="module")
def data():
  return gp._data()  # pylint: disable=protected-access


def _unsplit_train(x, y, make_optimizer, clip_norm=None, build=None):
  """(losses, weights) of one tape on the unsplit model (clipping the
  batch gradient to a global norm if asked)."""
  model = (build or gp._gpt)()  # pylint: disable=protected-access
  optimizer = make_optimizer()
  optimizer.build(model.trainable_variables)
  loss_obj = gp._loss()  # pylint: disable=protected-access

  @tf.function
  def step(xb, yb):
    with tf.GradientTape() as tape:
      loss = loss_obj(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    if clip_norm is not None:
      grads, _ = tf.clip_by_global_norm(grads, clip_norm)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  losses = [float(step(xb, yb)) for xb, yb in gp._batches(x, y)]  # pylint: disable=protected-access
  return losses, model.get_weights()


def _train(placed, x, y, make_optimizer, options=None):
  """The placed model's hook, its gradient reduction and the update.

  The loss averages each slice's rows over the whole batch, as tfmgpu's
  Trainer does, so the copies' losses and gradients add up.
  """
  optimizer = placed.build_optimizer(make_optimizer())
  per_example = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)

  def loss_fn(y_true, y_pred):
    return tf.reduce_sum(tf.reduce_mean(per_example(y_true, y_pred), -1)) \
        / gp.BATCH

  @tf.function
  def step(xb, yb):
    loss, _, grads = placed.compute_loss_and_gradients(xb, yb, loss_fn)
    grads = placed.reduce_gradients(grads, options)
    optimizer.apply_gradients(zip(grads, placed.trainable_variables))
    return loss

  losses = [float(step(xb, yb)) for xb, yb in gp._batches(x, y)]  # pylint: disable=protected-access
  return losses, step.get_concrete_function(*next(gp._batches(x, y)))  # pylint: disable=protected-access


def _assert_same(got, want, tol, build=None):
  (got_losses, got_weights), (want_losses, want_weights) = got, want
  np.testing.assert_allclose(got_losses, want_losses, rtol=tol)
  initial = (build or gp._gpt)().get_weights()  # pylint: disable=protected-access
  moved = max(np.abs(w - w0).max() for w, w0 in zip(want_weights, initial))
  assert moved > 10 * tol  # Training really moved the weights.
  for i, (u, v) in enumerate(zip(got_weights, want_weights)):
    np.testing.assert_allclose(u, v, rtol=tol, atol=tol, err_msg=f"weight {i}")


@pytest.fixture(scope="module")
def unsplit(data):
  """`unsplit(name, build=None, clip_norm=None)`: `_unsplit_train` with
  `gp.OPTIMIZERS[name]`, trained once per module (several layouts compare
  with the same run)."""
  cache = {}

  def run(name, build=None, clip_norm=None):
    key = (name, build, clip_norm)
    if key not in cache:
      cache[key] = _unsplit_train(*data, gp.OPTIMIZERS[name][0], clip_norm,
                                  build)
    return cache[key]

  return run


_REPLICA = re.compile(r"^(?:gradient_tape/)?replica_(\d+)/")


def _assert_replica_ops_on_their_devices(model, concrete):
  """Every op traced under a replica's scope sits on one of its devices;
  each replica has forward and backward matrix products on each of its
  stage devices."""
  mesh = [replicated.placed_devices(r) for r in model.replicas]
  seen = {}
  for p in inspection.op_placements(concrete):
    m = _REPLICA.match(p.name)
    if not m:
      continue
    r = int(m.group(1))
    if p.device == "" and (p.type in RESOURCE_OPS or p.colocated):
      continue
    assert p.device in mesh[r], (p.name, p.device, mesh[r])
    if p.type in ("MatMul", "BatchMatMulV2", "Einsum"):
      kind = "backward" if "backward" in p.name or "grad" in p.name.lower() \
          else "forward"
      seen.setdefault((r, p.device), set()).add(kind)
  for r, devices in enumerate(mesh):
    for d in set(devices):
      assert seen.get((r, d)) == {"forward", "backward"}, (r, d, seen)


def _group_sums(concrete):
  """{device: number of gradient sums} of the per-group all-reduce (an
  embedding's sparse gradients are joined, not added)."""
  out = {}
  for p in inspection.op_placements(concrete):
    if "group_all_reduce" in p.name and (
        p.type in ("AddN", "AddV2") or
        p.type == "ConcatV2" and p.name.endswith("/concat")):
      out[p.device] = out.get(p.device, 0) + 1
  return out


# ------------------------------------------------------ data x pipeline


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_data_x_pipeline_trains_as_unsplit(data, unsplit, cpu_devices, name):
  make, tol = gp.OPTIMIZERS[name]
  layout = hybrid.Layout(data=2, stages=2, micro_batches=gp.MICRO,
                         schedule="1f1b" if name == "adam" else "gpipe")
  model = hybrid.build_layout(gp._gpt(), layout, devices=cpu_devices)  # pylint: disable=protected-access
  assert isinstance(model, replicated.ReplicatedModel)
  assert model.devices == cpu_devices[:4]
  assert [r.stage_devices for r in model.replicas] == [
      tuple(cpu_devices[0:2]), tuple(cpu_devices[2:4])]
  losses, step = _train(model, *data, make)
  _assert_same((losses, model.to_unsplit().get_weights()), unsplit(name), tol)
  for r in model.replicas[1:]:  # The copies stay equal.
    for u, v in zip(r.to_unsplit().get_weights(),
                    model.replicas[0].to_unsplit().get_weights()):
      np.testing.assert_array_equal(u, v)
  _assert_replica_ops_on_their_devices(model, step)
  # One sum per variable, spread over the devices of each stage group.
  sums = _group_sums(step)
  assert sum(sums.values()) == len(model.replicas[0].trainable_variables)
  assert set(sums) == set(cpu_devices[:4])


def test_data_x_interleaved_pipeline_trains_as_unsplit(data, unsplit,
                                                       cpu_devices):
  """`virtual_stages=2`: each copy cut into 4 stages on its 2 devices
  (stage k on device k % 2), interleaved 1F1B, equal to unsplit SGD."""
  make, tol = gp.OPTIMIZERS["sgd"]
  layout = hybrid.Layout(data=2, stages=2, micro_batches=gp.MICRO,
                         schedule="1f1b", virtual_stages=2)
  model = hybrid.build_layout(gp._gpt(), layout, devices=cpu_devices)  # pylint: disable=protected-access
  assert [r.stage_devices for r in model.replicas] == [
      tuple(cpu_devices[k % 2] for k in range(4)),
      tuple(cpu_devices[2 + k % 2] for k in range(4))]
  assert all(r.virtual_stages == 2 for r in model.replicas)
  losses, step = _train(model, *data, make)
  _assert_same((losses, model.to_unsplit().get_weights()), unsplit("sgd"),
               tol)
  _assert_replica_ops_on_their_devices(model, step)


def test_data_x_one_stage_in_micro_batches_accumulates_as_unsplit(
    data, unsplit, cpu_devices):
  """One stage in micro-batches is gradient accumulation: each copy runs
  its half of the batch a micro-batch at a time (1F1B: one in flight) on
  its own device, and the update equals the unsplit model's (Adam)."""
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  make, tol = gp.OPTIMIZERS["adam"]
  layout = hybrid.Layout(data=2, stages=1, micro_batches=gp.MICRO,
                         schedule="1f1b")
  model = hybrid.build_layout(gp._gpt(), layout, devices=cpu_devices)  # pylint: disable=protected-access
  assert [type(r) for r in model.replicas] == [pipeline.PipelinedModel] * 2
  assert [r.stage_devices for r in model.replicas] == [
      (cpu_devices[0],), (cpu_devices[1],)]
  assert {(r.micro_batches, r.schedule) for r in model.replicas} == {
      (gp.MICRO, "1f1b")}
  losses, step = _train(model, *data, make)
  _assert_same((losses, model.to_unsplit().get_weights()), unsplit("adam"),
               tol)
  _assert_replica_ops_on_their_devices(model, step)


def test_data_x_pipeline_compresses_what_travels(data, unsplit, cpu_devices):
  model = hybrid.build_layout(
      gp._gpt(), hybrid.Layout(data=2, stages=2, micro_batches=2),  # pylint: disable=protected-access
      devices=cpu_devices)
  losses, step = _train(model, *data, gp.OPTIMIZERS["sgd"][0],
                        allreduce.AllReduceOptions(compression="float16"))
  casts = [p for p in inspection.op_placements(step)
           if "group_all_reduce" in p.name and p.type == "Cast"]
  assert casts  # Each copy's gradient is cast on its own device.
  np.testing.assert_allclose(losses, unsplit("sgd")[0], rtol=1e-3)


def test_layout_errors(cpu_devices):
  with pytest.raises(ValueError, match=r"needs 16 devices but 4 are given"):
    hybrid.build_layout(gp._gpt(), hybrid.Layout(data=4, stages=2, tensor=2),  # pylint: disable=protected-access
                        devices=cpu_devices)
  with pytest.raises(ValueError, match=r"plain data parallelism: use "
                     r"MirroredStrategy.*Trainer\(model, strategy='mirrored'"):
    hybrid.build_layout(gp._gpt(), hybrid.Layout(data=2),  # pylint: disable=protected-access
                        devices=cpu_devices)
  with pytest.raises(ValueError, match=r"To accumulate gradients over "
                     r"micro-batches .* micro_batches=N >= 2"):
    hybrid.build_layout(gp._gpt(), hybrid.Layout(data=2, micro_batches=1),  # pylint: disable=protected-access
                        devices=cpu_devices)
  with pytest.raises(ValueError, match=r"micro_batches=2 with the layout "
                     r"data 1 x stages 1 x tensor 2: tensor shards without "
                     r"stages do not run in micro-batches"):
    hybrid.build_layout(gp._gpt(), hybrid.Layout(tensor=2, micro_batches=2),  # pylint: disable=protected-access
                        devices=cpu_devices)
  with pytest.raises(ValueError, match=r"data=0 must be an int >= 1"):
    hybrid.Layout(data=0)


# ------------------------------------------- the Trainer and checkpoints


def _trainer(model, x, y, **kwargs):
  from tfmgpu.training import loop  # pylint: disable=g-import-not-at-top
  trainer = loop.Trainer(model, strategy=tf.distribute.get_strategy(),
                         optimizer="sgd", learning_rate=0.1,
                         loss=gp._loss(), verbose=0, **kwargs)  # pylint: disable=protected-access
  result = trainer.fit(x, y, epochs=1, global_batch_size=gp.BATCH,
                       shuffle=False)
  assert result.steps == gp.STEPS
  return result


def test_trainer_data_x_pipeline_saves_a_checkpoint_any_layout_reads(
    data, unsplit, cpu_devices, tmp_path):
  """The Trainer (clipping the summed gradient) trains R=2 x K=2 as the
  unsplit model; its checkpoint restores unsplit and as a 4-stage
  pipeline, with the same predictions."""
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import portable  # pylint: disable=g-import-not-at-top
  x, y = data
  model = hybrid.build_layout(
      gp._gpt(), hybrid.Layout(data=2, stages=2, micro_batches=2),  # pylint: disable=protected-access
      devices=cpu_devices)
  result = _trainer(model, x, y, clip_norm=0.05, model_dir=str(tmp_path))
  want = unsplit("sgd", clip_norm=0.05)  # The Trainer's SGD(0.1).
  np.testing.assert_allclose(result.history["loss"],
                             [np.mean(want[0])], rtol=1e-5)
  trained = model.to_unsplit()
  for u, v in zip(trained.get_weights(), want[1]):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)
  assert not np.allclose(want[0], unsplit("sgd")[0], rtol=1e-4)  # It did clip.
  path = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
  assert portable.has_view(path)
  expected = trained.predict(x, verbose=0)
  unsplit = portable.restore_weights(gp._gpt(seed=7), path)  # pylint: disable=protected-access
  np.testing.assert_allclose(unsplit.predict(x, verbose=0), expected,
                             rtol=1e-5, atol=1e-5)
  other = pipeline.PipelinedModel.from_model(gp._gpt(seed=7), num_stages=4,  # pylint: disable=protected-access
                                             micro_batches=2)
  portable.restore_weights(other, path)
  np.testing.assert_allclose(other.predict(x, batch_size=gp.BATCH, verbose=0),
                             expected, rtol=1e-5, atol=1e-5)
  copies = hybrid.build_layout(  # Every copy takes the weights.
      gp._gpt(seed=7), hybrid.Layout(data=2, stages=2),  # pylint: disable=protected-access
      devices=cpu_devices)
  portable.restore_weights(copies, path)
  np.testing.assert_allclose(copies.predict(x, batch_size=gp.BATCH,
                                            verbose=0),
                             expected, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="does not hold the weights of layers"):
    portable.restore_weights(
        gp.gpt.gpt(gp.SHAPE, gp.VOCAB, size="tiny", num_layers=3), path)


# -------------------------------------------------------- with tensor


_SHARD = re.compile(r"^(\w+?)_shard(\d+)(_backward)?(?:_\d+)?$")


def _gpt4(seed=0):
  """`gpt` tiny with 4 heads (so T=4 splits them)."""
  keras.utils.set_random_seed(seed)
  return gp.gpt.gpt(gp.SHAPE, gp.VOCAB, size="tiny", num_heads=4)


def shard_ops(concrete):
  """`{(replica, layer, shard, "forward" | "backward"): [OpPlacement]}` of
  the split layers' shards, from the traced step's name scopes."""
  out = {}
  for p in inspection.op_placements(concrete):
    m = _REPLICA.match(p.name)
    replica = int(m.group(1)) if m else 0
    parts = p.name.split("/")
    for i, part in enumerate(parts):
      s = _SHARD.match(part)
      if s:
        backward = bool(s.group(3)) or "gradient_tape" in parts[:i]
        key = (replica, s.group(1), int(s.group(2)),
               "backward" if backward else "forward")
        out.setdefault(key, []).append(p)
        break
  return out


def assert_shards_on_the_mesh(model, layout, devices, concrete):
  """Each split layer's shard `t` of stage `k` in replica `r` runs its
  forward and backward matrix products on `mesh[r][k][t]`, and nothing
  else of it runs elsewhere."""
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  mesh = layout.mesh(devices)
  ops = shard_ops(concrete)
  copies = getattr(model, "replicas", [model])
  for r, copy in enumerate(copies):
    parts = getattr(copy, "stages", None) or [copy.model]
    for k, part in enumerate(parts):
      split = [l for l in part.layers if isinstance(l, tensor.ShardedLayer)]
      assert split, (r, k)
      for layer in split:
        assert list(layer.devices) == mesh[r][k], (layer.name, r, k)
        for t, device in enumerate(mesh[r][k]):
          for kind in ("forward", "backward"):
            found = ops[(r, layer.name, t, kind)]
            assert any(p.type in ("MatMul", "BatchMatMulV2", "Einsum")
                       for p in found), (r, layer.name, t, kind)
            bad = [(p.name, p.device) for p in found
                   if p.device != device and not (
                       p.device == "" and (p.type in RESOURCE_OPS or
                                           p.colocated))]
            assert bad == [], (r, layer.name, t, kind)


@pytest.mark.parametrize("layout,name", [
    (hybrid.Layout(stages=2, tensor=2, micro_batches=2), "sgd"),
    (hybrid.Layout(data=2, tensor=2), "adam")])
def test_tensor_composes_with_pipeline_and_data(data, unsplit, cpu_devices,
                                                layout, name):
  make, tol = gp.OPTIMIZERS[name]
  model = hybrid.build_layout(_gpt4(), layout, devices=cpu_devices)
  losses, step = _train(model, *data, make)
  want = unsplit(name, build=_gpt4)
  _assert_same((losses, model.to_unsplit().get_weights()), want, tol,
               build=_gpt4)
  assert len(model.to_unsplit().get_weights()) == len(_gpt4().weights)
  assert_shards_on_the_mesh(model, layout, cpu_devices, step)


def test_keras_fit_trains_copies_as_unsplit(data, cpu_devices):
  """`fit` (its loss averages each copy's rows, so shares are 1/R) trains
  data 2 x pipeline 2 (1F1B) to unsplit `fit`'s weights."""
  x, y = data

  def fit(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=gp._loss())  # pylint: disable=protected-access
    history = model.fit(x, y, batch_size=gp.BATCH, epochs=1, shuffle=False,
                        verbose=0)
    return history.history["loss"]

  unsplit = gp._gpt()  # pylint: disable=protected-access
  want = fit(unsplit)
  copies = hybrid.build_layout(
      gp._gpt(), hybrid.Layout(data=2, stages=2, micro_batches=2,  # pylint: disable=protected-access
                               schedule="1f1b"), devices=cpu_devices)
  got = fit(copies)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for u, v in zip(copies.to_unsplit().get_weights(), unsplit.get_weights()):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes,message", [
    (dict(stages=1, micro_batches=4, schedule="1f1b"), "stages >= 2"),
    (dict(stages=2, micro_batches=4), "schedule='gpipe' cannot"),
    (dict(stages=2, micro_batches=4, schedule="1f1b", tensor=2),
     "tensor=2 is not built"),
    (dict(stages=2, micro_batches=3, schedule="1f1b"),
     "micro_batches=3 must be a multiple of the 2 devices"),
])
def test_an_interleaved_layout_it_cannot_build_is_refused(sizes, message):
  """Virtual stages were ignored without stages and crashed (an index past
  the stage grid) with tensor shards: both now refused by name."""
  with pytest.raises(ValueError, match=re.escape(message)):
    hybrid.Layout(virtual_stages=2, **sizes)
  assert "2 virtual stages each" in hybrid.Layout(
      stages=2, micro_batches=4, schedule="1f1b", virtual_stages=2).label


def _token_tagger(mask_zero):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,), dtype="int32")
  h = keras.layers.Embedding(12, 8, mask_zero=mask_zero, name="embed")(inputs)
  h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
  return keras.Model(inputs, keras.layers.Dense(12, name="logits")(h))


@pytest.mark.parametrize("sizes,mask_zero,message", [
    (dict(data=2, stages=2), True, "carries a Keras mask"),
    (dict(stages=2, micro_batches=2, schedule="1f1b"), False,
     "schedule='1f1b' averages the losses of its 2 micro-batches, but loss"),
    (dict(data=2, stages=2), False, "2 data-parallel copies average"),
])
def test_a_loss_averaged_over_counted_targets_is_refused_where_split(
    sizes, mask_zero, message, cpu_devices):
  """Each data copy (or 1F1B micro-batch) averaged over its own valid
  tokens: 1.1e-2 from one-device Keras fit in 3 steps, with no error."""
  placed_model = hybrid.build_layout(_token_tagger(mask_zero),
                                     hybrid.Layout(**sizes),
                                     devices=cpu_devices)
  placed_model.compile(optimizer=keras.optimizers.SGD(0.5),
                       loss=keras.losses.SparseCategoricalCrossentropy(
                           from_logits=True,
                           ignore_class=None if mask_zero else 0))
  x = np.random.default_rng(0).integers(0, 12, (8, 6))
  with pytest.raises(ValueError, match=re.escape(message)):
    placed_model.fit(x, x, batch_size=8, verbose=0)


class _Custom(keras.optimizers.Optimizer):
  """An optimizer class tfmgpu does not know (unless it says so)."""

  def update_step(self, gradient, variable, learning_rate):
    variable.assign_sub(gradient * learning_rate)


@pytest.mark.parametrize("make,message", [
    (lambda: keras.optimizers.Adafactor(0.05), "Adafactor factors"),
    (lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
     "clipnorm=0.05 clips each variable by its own norm"),
    (lambda: keras.optimizers.Lamb(0.01), "Lamb scales"),
    (lambda: keras.optimizers.Muon(0.01), "Muon orthogonalises"),
])
def test_an_optimizer_reading_whole_variables_is_refused_on_shards(
    make, message, cpu_devices):
  """Each shard was updated as a whole variable: Muon 2.5e-2, Adafactor
  6.3e-3, per-variable clipnorm 3.8e-3 from one-device fit, silently."""
  model = hybrid.build_layout(gp._gpt(), hybrid.Layout(tensor=2),  # pylint: disable=protected-access
                              devices=cpu_devices[:2])
  with pytest.raises(ValueError, match=re.escape(message) + ".* into shards"):
    model.compile(optimizer=make(), loss=gp._loss())  # pylint: disable=protected-access


def test_an_unknown_optimizer_on_shards_is_refused_unless_elementwise(
    cpu_devices):
  model = hybrid.build_layout(gp._gpt(), hybrid.Layout(tensor=2),  # pylint: disable=protected-access
                              devices=cpu_devices[:2])
  with pytest.raises(ValueError, match="_Custom is not one of the element"):
    model.compile(optimizer=_Custom(learning_rate=0.1), loss=gp._loss())  # pylint: disable=protected-access
  trusted = _Custom(learning_rate=0.1)
  trusted.elementwise = True
  model.compile(optimizer=trusted, loss=gp._loss())  # pylint: disable=protected-access
  model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0),
                loss=gp._loss())  # pylint: disable=protected-access


@pytest.mark.parametrize("first,then", [
    (dict(tensor=2), dict(stages=2)),  # Shards: no checkpoint read back.
    (dict(stages=2), dict(data=2, stages=2)),  # Copies: objects unmatched.
])
def test_a_resume_whose_slots_cannot_follow_the_layout_says_so(
    first, then, data, cpu_devices, tmp_path):
  """It said the directory was damaged ("restore it from a copy"), or
  dumped an AssertionError of 114 unmatched variables."""
  from tfmgpu.training import loop  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import slot_order  # pylint: disable=g-import-not-at-top
  x, y = data
  for layout, raises in ((first, False), (then, True)):
    model = hybrid.build_layout(gp._gpt(), hybrid.Layout(**layout),  # pylint: disable=protected-access
                                devices=cpu_devices)
    trainer = loop.Trainer(model, strategy=tf.distribute.get_strategy(),
                           optimizer="adam", loss=gp._loss(), verbose=0,  # pylint: disable=protected-access
                           model_dir=str(tmp_path))
    if raises:
      with pytest.raises(slot_order.SlotOrderError,
                         match="optimizer slots for other variables.*"
                         "Resume in the layout the run was saved in"):
        trainer.fit(x, y, epochs=2, global_batch_size=gp.BATCH)
    else:
      trainer.fit(x, y, epochs=1, global_batch_size=gp.BATCH)
  assert os.listdir(tmp_path / "checkpoints")  # Left as they were.


def test_weight_decay_excluded_by_object_is_refused_on_copies(cpu_devices):
  """The placed copies' variables are not the ones excluded: they were
  decayed (2.8e-2 off one device), silently; by name they follow."""
  unsplit = gp._gpt()  # pylint: disable=protected-access
  model = hybrid.build_layout(unsplit, hybrid.Layout(stages=2),
                              devices=cpu_devices[:2])
  optimizer = keras.optimizers.AdamW(weight_decay=0.5)
  optimizer.exclude_from_weight_decay(var_list=[
      v for v in unsplit.trainable_variables if len(v.shape) == 1])
  with pytest.raises(ValueError, match="exclude_from_weight_decay"):
    model.compile(optimizer=optimizer, loss=gp._loss())  # pylint: disable=protected-access
  by_name = keras.optimizers.AdamW(weight_decay=0.5)
  by_name.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
  model.compile(optimizer=by_name, loss=gp._loss())  # pylint: disable=protected-access


def test_a_global_keras_distribution_is_said_to_be_ignored(cpu_devices,
                                                           caplog):
  """`keras.distribution.set_distribution(ModelParallel(layout_map=...))`
  (or `DataParallel`) is ignored by Keras on TF, and by tfmgpu: silently,
  until now."""
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  x = keras.Input((4,))
  h = keras.layers.Dense(4, name="a")(x)
  model = keras.Model(x, keras.layers.Dense(2, name="b")(h))
  said = r"A Keras distribution is set \(DataParallel.*ignores it.*%s.*layout_map="
  with caplog.at_level("WARNING", logger="absl"):
    Trainer(model, optimizer="sgd", loss="mse")
    hybrid.build_layout(model, hybrid.Layout(stages=2),
                        devices=cpu_devices[:2])
  assert "Keras distribution" not in caplog.text
  keras.distribution.set_distribution(
      keras.distribution.DataParallel(devices=cpu_devices[:2]))
  try:
    with caplog.at_level("WARNING", logger="absl"):
      Trainer(model, optimizer="sgd", loss="mse")
      assert re.search(said % "Trainer", caplog.text)
      caplog.clear()
      hybrid.build_layout(model, hybrid.Layout(stages=2),
                          devices=cpu_devices[:2])
      assert re.search(said % "build_layout", caplog.text)
  finally:
    keras.distribution.set_distribution(None)
