"""ZeRO stages 1-3 (`tfmgpu.parallel.zero`): trained equal to plain data
parallelism (`MirroredStrategy` over the same devices, same Trainer), each
shard's weights and slots on its owner in the traced step, and per-device
bytes that fall as each stage says.
"""

import json
import logging
import re
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu.models import gpt
from tfmgpu.parallel import zero
from tfmgpu.parallel import zero_memory
from tfmgpu.training import replica_state
from tfmgpu.training.loop import Trainer

TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
STEPS = 3
T = 8


def _bn_model(seed=0, policy=None):
  """A Keras functional model with BatchNorm (its statistics per replica)."""
  keras.utils.set_random_seed(seed)
  if policy:
    keras.mixed_precision.set_dtype_policy(policy)
  try:
    inputs = keras.Input((12,))
    h = keras.layers.Dense(24, name="dense_in")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Dense(16, activation="relu", name="dense_mid")(h)
    outputs = keras.layers.Dense(4, dtype="float32", name="logits")(h)
    return keras.Model(inputs, outputs, name="bn_net")
  finally:
    keras.mixed_precision.set_dtype_policy("float32")


def _gpt(seed=0):
  keras.utils.set_random_seed(seed)
  return gpt.gpt((T,), 32, size="tiny")


def _data(model_name, rows):
  rng = np.random.RandomState(3)
  if model_name == "gpt":
    return (rng.randint(0, 32, (rows, T)).astype("int32"),
            rng.randint(0, 32, (rows, T)).astype("int32"))
  return (rng.normal(size=(rows, 12)).astype("float32"),
          rng.randint(0, 4, rows).astype("int32"))


BUILD = {"bn": _bn_model, "gpt": _gpt}


def _fit(model, x, y, optimizer, batch, strategy=None, clip_norm=None,
         **settings):
  trainer = Trainer(model, strategy=strategy, optimizer=optimizer,
                    learning_rate=0.05 if optimizer == "sgd" else 0.01,
                    clip_norm=clip_norm, verbose=0, metrics=[], **settings)
  result = trainer.fit(x, y, epochs=1, global_batch_size=batch,
                       steps_per_epoch=STEPS, shuffle=False)
  return result, trainer


def _mirrored(name, replicas, optimizer, clip_norm=None, policy=None):
  """Weights after plain data parallelism; BN statistics as the mean of
  the replicas' own (MirroredStrategy lets each replica's drift apart; the
  Trainer's setting them all to the first's after fit is left out here)."""
  devices = tfmgpu.list_devices("CPU")[:replicas]
  strategy = tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    model = (BUILD[name]() if policy is None else BUILD[name](policy=policy))
  x, y = _data(name, STEPS * 8 * replicas)
  with mock.patch.object(replica_state, "agree", lambda model: 0):
    _fit(model, x, y, optimizer, 8 * replicas, strategy, clip_norm)
  return [np.mean([c.numpy() for c in v.value.values], axis=0)
          for v in model.weights]


def _sharded(name, replicas, stage, optimizer, clip_norm=None, policy=None):
  devices = tfmgpu.list_devices("CPU")[:replicas]
  model = BUILD[name]() if policy is None else BUILD[name](policy=policy)
  sharded = zero.ShardedModel(model, devices, stage=stage)
  x, y = _data(name, STEPS * 8 * replicas)
  _, trainer = _fit(sharded, x, y, optimizer, 8 * replicas, None, clip_norm)
  return sharded, trainer


def _assert_equal(sharded, want, optimizer):
  got = [v.numpy() for v in sharded.unsplit.weights]
  initial = BUILD["gpt" if "gpt" in sharded.unsplit.name else "bn"]()
  moved = max(np.abs(w - w0).max()
              for w, w0 in zip(want, initial.get_weights()))
  assert moved > 10 * TOLERANCE[optimizer]  # Training did change weights.
  for v, g, w in zip(sharded.unsplit.weights, got, want):
    np.testing.assert_allclose(g, w, atol=TOLERANCE[optimizer], rtol=0,
                               err_msg=v.path)


# Stage 3 over 4 owners trains in ("bn", 4, 3, ...), SGD at stage 3 there
# too; GPT at stage 3 (its embedding, Adam, clipping) over 2.
CASES = [  # model, replicas, stage, optimizer, clip_norm
    ("bn", 2, 1, "sgd", None), ("bn", 2, 2, "adam", 0.5),
    ("bn", 2, 3, "adam", None), ("bn", 4, 3, "sgd", 0.5),
    ("gpt", 2, 1, "adam", 1.0), ("gpt", 2, 3, "adam", 1.0),
]


@pytest.fixture(scope="module")
def references():
  cache = {}

  def get(name, replicas, optimizer, clip_norm, policy=None):
    key = (name, replicas, optimizer, clip_norm, policy)
    if key not in cache:
      cache[key] = _mirrored(name, replicas, optimizer, clip_norm, policy)
    return cache[key]
  return get


@pytest.mark.parametrize("name,replicas,stage,optimizer,clip_norm", CASES)
def test_trains_equal_to_mirrored(references, name, replicas, stage,
                                  optimizer, clip_norm):
  sharded, _ = _sharded(name, replicas, stage, optimizer, clip_norm)
  _assert_equal(sharded, references(name, replicas, optimizer, clip_norm),
                optimizer)


def test_trainer_zero_stage_shards_over_its_strategy_devices(references):
  """`Trainer(zero_stage=2)` given a MirroredStrategy and a model built in
  its scope: sharded over the strategy's devices, trained equal to it."""
  devices = tfmgpu.list_devices("CPU")[:2]
  strategy = tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    model = _bn_model()
  x, y = _data("bn", STEPS * 16)
  _, trainer = _fit(model, x, y, "sgd", 16, strategy, zero_stage=2)
  sharded = trainer.model
  assert isinstance(sharded, zero.ShardedModel) and sharded.stage == 2
  assert sharded.devices == list(strategy.extended.worker_devices)
  assert trainer.num_replicas == 1  # The model places its own replicas.
  _assert_equal(sharded, references("bn", 2, "sgd", None), "sgd")
  again = Trainer(sharded, zero_stage=2, verbose=0, metrics=[])
  assert again.model is sharded
  with pytest.raises(ValueError, match=r"zero_stage=3 but model .* is "
                     r"already sharded at stage 2"):
    Trainer(sharded, zero_stage=3)
  with strategy.scope(), pytest.raises(ValueError, match=r"zero_stage=1: "
                                       r"create the Trainer outside"):
    Trainer(_bn_model(), strategy=strategy, zero_stage=1)


def test_trainer_zero_stage_uses_every_local_device():
  from tfmgpu.strategies import replicas  # pylint: disable=g-import-not-at-top
  trainer = Trainer(_gpt(), zero_stage=3, verbose=0, metrics=[])
  assert trainer.model.devices == replicas.select_replica_devices(
      None, None, None)
  assert {zero.device_name(d) for d in trainer.model.owners.values()} == {
      zero.device_name(d) for d in trainer.model.devices}


def test_trainer_zero_stage_refuses_a_placed_model():
  """Re-homing a pipeline's variables to ZeRO owners would undo its
  placement without a word: refused, naming what to do."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  placed = hybrid.build_layout(
      _gpt(), hybrid.Layout(stages=2, micro_batches=2),
      devices=tfmgpu.list_devices("CPU")[:2])
  with pytest.raises(ValueError, match=r"zero_stage=2 .* already placed "
                     r"over devices \(PipelinedModel\)\. Shard the unsplit"):
    Trainer(placed, zero_stage=2)


def test_mixed_precision_equal_to_mirrored(references):
  sharded, trainer = _sharded("bn", 2, 3, "adam", 1.0,
                              policy="mixed_float16")
  assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
  _assert_equal(sharded,
                references("bn", 2, "adam", 1.0, policy="mixed_float16"),
                "adam")


def _spec(device):
  spec = tf.DeviceSpec.from_string(device)
  return spec.device_type, spec.device_index or 0


def test_stage3_step_keeps_each_shard_on_its_owner():
  """In the traced step every op on a weight or slot runs on its owner:
  the forward's reads are placed there (each replica then receives the
  value: an Identity on its own device), the updates are too, and the
  rest of the resource ops carry no device (TF runs them where the
  resource lives)."""
  devices = tfmgpu.list_devices("CPU")[:2]
  sharded = zero.ShardedModel(_gpt(), devices, stage=3)
  optimizer = sharded.build_optimizer(keras.optimizers.Adam(1e-3))
  per_example = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)

  @tf.function
  def step(x, y):
    loss, _, grads = sharded.compute_loss_and_gradients(
        x, y, lambda t, p: tf.reduce_sum(per_example(t, p)) / 16.0)
    grads = sharded.reduce_gradients(grads)
    optimizer.apply_gradients(zip(grads, sharded.trainable_variables))
    return loss

  x, y = _data("gpt", 16)
  graph = step.get_concrete_function(x, y).graph
  captured = {id(outer): inner for outer, inner in graph.captures}
  slots = [v for v in optimizer.variables
           if v is not optimizer.iterations and "learning_rate" not in v.path]
  assert len(slots) == 2 * len(sharded.trainable_variables)
  owners_used = set()
  weight_ids = {id(v) for v in sharded.weights}
  for v in list(sharded.weights) + slots:
    storage = v.value
    owner = _spec(storage.device)
    owners_used.add(owner)
    placed_ops = [op for op in captured[id(storage.handle)].consumers()
                  if op.device]
    assert placed_ops, v.path
    for op in placed_ops:
      assert _spec(op.device) == owner, (v.path, op.type, op.device)
    if id(v) in weight_ids:
      reads = [op for op in placed_ops if op.type == "ReadVariableOp"]
      assert len(reads) == 2, v.path  # One per replica, on the owner.
      receivers = {_spec(c.device) for r in reads
                   for c in r.outputs[0].consumers()}
      assert receivers == {_spec(d) for d in devices}, v.path
  assert owners_used == {_spec(d) for d in devices}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_live_bytes_match_the_estimate_and_fall_to_a_share(stage):
  devices = tfmgpu.list_devices("CPU")[:4]
  strategy = tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    mirrored = _gpt()
    mirrored_opt = keras.optimizers.Adam()
    mirrored_opt.build(mirrored.trainable_variables)
  plain = zero.bytes_by_device(mirrored.weights)
  plain_slots = zero.bytes_by_device(mirrored_opt._momentums  # pylint: disable=protected-access
                                     + mirrored_opt._velocities)  # pylint: disable=protected-access
  sharded = zero.ShardedModel(_gpt(), devices, stage=stage)
  optimizer = sharded.build_optimizer(keras.optimizers.Adam())
  live = sharded.live_bytes(optimizer)
  estimate = zero_memory.account_model(sharded.unsplit, devices, stage, "adam")
  mirrored_rows = zero_memory.account_model(sharded.unsplit, devices, 0,
                                            "adam")
  total_weights = sum(plain.values()) // 4
  for row, base in zip(estimate, mirrored_rows):
    name = zero.device_name(row.device)
    assert live[name] == {"weights": row.weights, "slots": row.slots}
    assert plain[name] == base.weights == total_weights
    assert plain_slots[name] == base.slots == 2 * total_weights
    assert row.slots < 0.3 * base.slots  # About 1/4, by whole variables.
    if stage == 3:
      assert row.weights < 0.3 * base.weights
    else:
      assert row.weights == base.weights
    assert row.gradients == (base.gradients if stage == 1
                             else live[name]["slots"] // 2)


def _fit_dir(sharded, x, y, model_dir, epochs):
  trainer = Trainer(sharded, optimizer="adam", learning_rate=0.01,
                    verbose=0, metrics=[], model_dir=model_dir)
  try:
    return trainer.fit(x, y, epochs=epochs, global_batch_size=32,
                       steps_per_epoch=2, shuffle=False)
  finally:
    trainer.close()


def test_stage3_checkpoint_restores_into_any_layout_and_resumes(tmp_path):
  """A stage-3 run on 2 devices: its checkpoint restores unsplit, as
  mirrored x2 and as a 2-stage pipeline (same predictions); its .keras
  loads; a stage-1 run resumes from it exactly where it stopped. (Stage 3
  over 4 owners trains in `test_trains_equal_to_mirrored`.)"""
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import portable  # pylint: disable=g-import-not-at-top
  devices = tfmgpu.list_devices("CPU")[:2]
  x, y = _data("gpt", 64)
  whole = zero.ShardedModel(_gpt(), devices, stage=3)
  _fit_dir(whole, x, y, str(tmp_path / "whole"), epochs=2)
  sharded = zero.ShardedModel(_gpt(), devices, stage=3)
  _fit_dir(sharded, x, y, str(tmp_path / "run"), epochs=1)
  path = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
  assert portable.has_view(path)
  expected = sharded.predict(x[:16], batch_size=16, verbose=0)
  np.testing.assert_allclose(expected, sharded.unsplit.predict(
      x[:16], batch_size=16, verbose=0), rtol=1e-5, atol=1e-5)
  unsplit = portable.restore_weights(_gpt(seed=7), path)
  np.testing.assert_allclose(unsplit.predict(x[:16], verbose=0), expected,
                             rtol=1e-5, atol=1e-5)
  strategy = tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
  with strategy.scope():
    mirrored = portable.restore_weights(_gpt(seed=7), path)
    plain = _gpt(seed=7)  # Read as a plain model's checkpoint (its keys).
    tf.train.Checkpoint(model=plain).read(path).expect_partial()
  for model in (mirrored, plain):
    np.testing.assert_allclose(model.predict(x[:16], verbose=0), expected,
                               rtol=1e-5, atol=1e-5)
  staged = pipeline.PipelinedModel.from_model(_gpt(seed=7), num_stages=2,
                                              micro_batches=2)
  portable.restore_weights(staged, path)
  np.testing.assert_allclose(staged.predict(x[:16], batch_size=16, verbose=0),
                             expected, rtol=1e-5, atol=1e-5)
  saved = str(tmp_path / "model.keras")
  sharded.to_unsplit().save(saved)
  loaded = keras.models.load_model(saved, custom_objects=gpt.custom_objects())
  np.testing.assert_allclose(loaded.predict(x[:16], verbose=0), expected,
                             rtol=1e-5, atol=1e-5)
  resumed = zero.ShardedModel(_gpt(seed=7), devices, stage=1)
  result = _fit_dir(resumed, x, y, str(tmp_path / "run"), epochs=2)
  assert result.initial_epoch == 1 and result.epochs_run == 1
  for v, w in zip(resumed.unsplit.weights, whole.unsplit.weights):
    np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-6, rtol=0,
                               err_msg=v.path)


def _nested(seed=0):
  """A functional model around a functional backbone (a keras_hub task's
  shape): the backbone's layers are where the weights are."""
  keras.utils.set_random_seed(seed)
  inner_in = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu", name="inner1")(inner_in)
  backbone = keras.Model(inner_in, keras.layers.Dense(16, name="inner2")(h),
                         name="backbone")
  inputs = keras.Input((8,))
  outputs = keras.layers.Dense(3, name="head")(backbone(inputs))
  return keras.Model(inputs, outputs, name="nested")


def test_checkpoint_of_a_nested_model_restores_into_other_layouts(tmp_path):
  """ZeRO keyed its checkpoint's portable view by the top-level layers (the
  backbone whole), every other layout by the backbone's own layers: a
  ZeRO run of a keras_hub model resumed as a pipeline (or a pipeline run
  as ZeRO) failed with "variables do not match". Now the keys agree."""
  from tfmgpu.training import portable  # pylint: disable=g-import-not-at-top
  devices = tfmgpu.list_devices("CPU")[:2]
  sharded = zero.ShardedModel(_nested(), devices, stage=3)
  staged = tfmgpu.StagedModel(_nested(seed=5), tfmgpu.plan_stages(
      _nested(seed=5), 2, split_points=["inner2"]))
  assert (sorted(sharded.weighted_layers())
          == sorted(staged.weighted_layers())
          == sorted(portable.weighted_layers(_nested()))
          == ["head", "inner1", "inner2"])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  y = rng.integers(0, 3, 64)
  _fit_dir(sharded, x, y, str(tmp_path / "run"), epochs=1)
  path = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
  expected = sharded.predict(x, batch_size=16, verbose=0)
  for target in (_nested(seed=7), staged):
    portable.restore_weights(target, path)
    np.testing.assert_allclose(target.predict(x, batch_size=16, verbose=0),
                               expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("parsed_flags")
def test_plan_only_prints_the_live_bytes_of_each_device(capsys):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import models, train  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import plan  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(strategy="mirrored", model="gpt",
                           model_size="tiny", zero_stage=3, num_replicas=4,
                           optimizer="adam", plan_only=True):
    assert train.main(["train"]) == 0
  printed = {m[0]: m[1:] for m in re.findall(
      r"^3\s+(\S+)\s+([\d.]+ \w+)\s+[\d.]+ \w+\s+([\d.]+ \w+)",
      capsys.readouterr().out, re.M)}
  devices = tfmgpu.list_devices("CPU")[:4]
  sharded = zero.ShardedModel(models.build_model(
      "gpt", input_shape=(gpt.CONTEXTS["tiny"],), num_classes=256,
      size="tiny"), devices, stage=3)
  live = sharded.live_bytes(sharded.build_optimizer(keras.optimizers.Adam()))
  fmt = plan._fmt_bytes  # pylint: disable=protected-access
  assert printed == {d: (fmt(b["weights"]), fmt(b["slots"]))
                     for d, b in live.items()}


def test_zero_stage_is_refused_where_it_does_not_work():
  with pytest.raises(ValueError, match=r"zero_stage=3 is not supported by "
                     r"strategy='central_storage'.*--strategy=mirrored "
                     r"--zero_stage=3.*multi_worker_mirrored across hosts"):
    tfmgpu.TrainConfig(strategy="central_storage", zero_stage=3)
  with pytest.raises(ValueError, match=r"zero_stage=2 with cluster_resolver="
                     r"'slurm'.*TF_CONFIG"):
    tfmgpu.TrainConfig(strategy="multi_worker_mirrored", zero_stage=2,
                       cluster_resolver="slurm")
  with pytest.raises(ValueError, match=r"zero_stage=4 is unknown"):
    tfmgpu.TrainConfig(strategy="mirrored", zero_stage=4)
  with pytest.raises(ValueError, match=r"zero_stage=0 keeps a whole copy"):
    zero.ShardedModel(_gpt(), tfmgpu.list_devices("CPU")[:2], stage=0)
  # TF placed the shards meant for a missing GPU on a CPU, silently.
  with pytest.raises(ValueError, match=r"device '/device:GPU:0' does not "
                     r"exist here. Devices found: /device:CPU:0"):
    zero.ShardedModel(_gpt(), ["/device:GPU:0", "/device:CPU:1"], stage=3)
  with pytest.raises(ValueError, match=r"get_strategy cannot shard.*"
                     r"ShardedModel"):
    tfmgpu.get_strategy("mirrored", zero_stage=2)


@pytest.mark.usefixtures("parsed_flags")
def test_cli_trains_mirrored_zero_stage_3_and_resumes_as_a_pipeline(
    tmp_path, capsys, caplog):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import train  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(strategy="mirrored", zero_stage=3, model="gpt",
                           num_replicas=2,
                           model_size="tiny", epochs=1, steps_per_epoch=2,
                           steps_per_execution=2, model_dir=str(tmp_path),
                           verbose=0):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"^replicas\s+2 on /device:CPU:0, .*CPU:1$", out, re.M)
  assert re.search(r"^zero\s+stage 3: weights, gradients and optimizer "
                   r"slots sharded", out, re.M)
  assert (tmp_path / "model.keras").exists()
  # The run resumes as a 2-stage pipeline: its checkpoint restores there
  # (weights by layer name, the optimizer's slots and step).
  with flagsaver.flagsaver(strategy="pipeline", num_stages=2, model="gpt",
                           model_size="tiny", epochs=2, steps_per_epoch=2,
                           model_dir=str(tmp_path), verbose=0):
    with caplog.at_level(logging.INFO):
      assert train.main(["train"]) == 0
  assert re.search(r"^stages\s+2 on ", capsys.readouterr().out, re.M)
  assert "Resumed from" in caplog.text
  assert "after 1 whole epoch, global step 2" in caplog.text
  assert json.loads((tmp_path / "run.json").read_text())["placement"] == (
      "pipeline (num_stages=2, partition=balanced)")


def test_dropout_mixed_precision_predict_and_a_short_batch():
  """Outsider finds: a Dropout's seed state had no owner (KeyError in the
  step); predict under a mixed_float16 policy read an autocast tensor as
  a variable (AttributeError); a short last batch failed in `split` with
  no word of why."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    with strategy.scope():
      keras.utils.set_random_seed(0)
      inputs = keras.Input((4,))
      hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(8)(inputs))
      model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(
          hidden))
    trainer = Trainer(model, strategy=strategy, zero_stage=3, loss="mse",
                      metrics=[], verbose=0)
    x = np.ones((8, 4), np.float32)
    trainer.fit(x, np.zeros((8, 2), np.float32), global_batch_size=8)
    assert tfmgpu.predict(trainer.model, x).shape == (8, 2)
    short = tf.data.Dataset.from_tensor_slices((x[:5], x[:5, :2])).batch(4)
    with pytest.raises(ValueError, match=r"A batch of 1 examples has fewer "
                       r"rows than data_parallel=2 .*drop_remainder=True"):
      trainer.fit(short)
  finally:
    keras.mixed_precision.set_global_policy("float32")


def test_a_short_last_batch_trains_as_keras_fit():
  """A trial's `timeseries_dataset_from_array` (a last batch of 3 rows over
  2 replicas) stopped mid-epoch at ZeRO's "equal parts" assertion, where
  mirrored trains it. The replicas now take near-equal parts, each mean
  weighted by its rows (an activity regulariser's too)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(11, 4)).astype("float32")
  y = rng.normal(size=(11, 2)).astype("float32")

  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh", name="hidden",
                           activity_regularizer=keras.regularizers.L2(0.1)),
        keras.layers.Dense(2, name="out")], name="short_batches")

  reference = build()
  reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = build()
  Trainer(model, strategy=strategy, zero_stage=3, loss="mse", metrics=[],
          optimizer=keras.optimizers.Adam(1e-2), verbose=0).fit(
              tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=2)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-6)


class _Float32Head(keras.layers.Layer):
  """Logits in float32 from a mixed-precision model's bfloat16 features, as
  keras_hub's ReversibleEmbedding gives them: the layer does not autocast,
  so it reads its kernel in float32."""

  def __init__(self, units, **kwargs):
    super().__init__(**kwargs)
    self.units, self.autocast = units, False

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], self.units),
                                  initializer="glorot_uniform")

  def call(self, x):
    return keras.ops.matmul(keras.ops.cast(x, "float32"), self.kernel)


def test_mixed_precision_shards_as_keras_calls_the_model():
  """A trial's mixed_bfloat16 Llama: its replicas' `stateless_call` read
  the float32 logits' kernel in bfloat16 (Keras' call does not): 4.5e-4
  off in predict, and 3e-4 off mirrored over as many replicas after 4
  steps (7.9e-5 from one device), silently."""
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh", name="d")(inputs)
    model = keras.Model(inputs, _Float32Head(5, name="head")(hidden),
                        name="mixed")
    strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
    with strategy.scope():  # Its replicas split the batch as ZeRO's do.
      reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    rows = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    labels = np.arange(8) % 5
    want = reference.predict(rows, verbose=0)
    sharded = zero.ShardedModel(model, tfmgpu.list_devices("CPU")[:2],
                                stage=3)
    np.testing.assert_allclose(sharded.predict(rows, verbose=0), want,
                               atol=1e-6)
    Trainer(sharded, optimizer="sgd", learning_rate=0.5, verbose=0).fit(
        rows, labels, global_batch_size=8, epochs=1)
    Trainer(reference, strategy=strategy, optimizer="sgd", learning_rate=0.5,
            verbose=0).fit(rows, labels, global_batch_size=8, epochs=1)
    for got, wanted in zip(model.get_weights(), reference.get_weights()):
      np.testing.assert_allclose(got, wanted, atol=1e-6)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  # A model in bfloat16 throughout keeps its weights' dtype (the review:
  # the first mend read them as float32, and the step failed).
  plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(
      4, dtype="bfloat16", name="b16")], name="pure")
  want = plain.predict(rows, verbose=0)
  np.testing.assert_array_equal(zero.ShardedModel(
      plain, tfmgpu.list_devices("CPU")[:2], stage=3).predict(
          rows, verbose=0), want)


def test_predictions_made_before_sharding_follow_the_trained_weights():
  """Sharding gives each variable new storage: a predict function traced
  before (tfmgpu's cached one, Keras' own) kept serving the initial
  weights, 0.70 off."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                            keras.layers.Dense(2)])
  x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
  before = tfmgpu.predict(model, x)
  model.predict(x, verbose=0)
  Trainer(model, zero_stage=2, optimizer="sgd", learning_rate=0.5,
          verbose=0).fit(x, np.arange(32) % 2, global_batch_size=8, epochs=2)
  fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                            keras.layers.Dense(2)])
  fresh.set_weights(model.get_weights())
  want = fresh.predict(x, verbose=0)
  assert np.abs(want - before).max() > 0.1  # Training moved them.
  np.testing.assert_allclose(tfmgpu.predict(model, x), want, atol=1e-5)
  np.testing.assert_allclose(model.predict(x, verbose=0), want, atol=1e-5)


def test_synchronized_batchnorm_not_synced_by_copies_says_so(caplog):
  """ShardedModel and ReplicatedModel run their data-parallel copies
  outside a replica context, where BatchNormalization(synchronized=True)
  cannot all-reduce: it trained 0.012 off mirrored (which syncs it) with
  no word. Plain BatchNorm (per replica, as mirrored) says that it
  differs from one device (a new user's trial: 1.1e-2, unsaid)."""
  from tfmgpu.parallel import hybrid  # pylint: disable=import-outside-toplevel
  devices = tfmgpu.list_devices("CPU")[:2]

  def bn_model(synchronized):
    inputs = keras.Input((12,))
    h = keras.layers.BatchNormalization(synchronized=synchronized,
                                        name="sync_bn")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h))

  with caplog.at_level(logging.WARNING):
    zero.ShardedModel(bn_model(False), devices, stage=1)
  assert "synchronized=True" not in caplog.text
  assert ("BatchNormalization layers (sync_bn) normalise each of its 2 "
          "data-parallel copies' rows by their own statistics, as mirrored "
          "does, so training differs from one device") in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    zero.ShardedModel(bn_model(True), devices, stage=1)
  assert ("BatchNormalization layers sync_bn ask for synchronized=True, but "
          "each of its 2 data-parallel copies normalises its own rows"
          ) in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    hybrid.build_layout(bn_model(True), hybrid.Layout(data=2, stages=2),
                        devices=tfmgpu.list_devices("CPU")[:4])
  assert "each of its 2 data-parallel copies" in caplog.text


def test_a_subclassed_model_shards_predicts_and_trains_as_it_is():
  """The review: naming a model's outputs read `model.outputs`, which a
  subclassed model has not, after its variables had moved to owners. Its
  `call` takes no `training` (Keras' fit drops the argument; the replicas'
  `stateless_call` passed it on, and failed)."""

  class Sub(keras.Model):
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.dense = keras.layers.Dense(4, name="d")

    def call(self, x):
      return self.dense(x)

  model, reference = Sub(name="sub"), Sub(name="ref")
  rows = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
  want = model.predict(rows, verbose=0)
  reference(rows)
  reference.set_weights(model.get_weights())
  sharded = zero.ShardedModel(model, tfmgpu.list_devices("CPU")[:2], stage=3)
  assert sharded.unsplit_output_names == ()
  np.testing.assert_allclose(sharded.predict(rows, verbose=0), want,
                             atol=1e-6)
  targets = np.ones((6, 4), "float32")
  Trainer(sharded, optimizer="sgd", loss="mse", learning_rate=0.1,
          verbose=0).fit(rows, targets, global_batch_size=6, epochs=1)
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  reference.fit(rows, targets, batch_size=6, shuffle=False, verbose=0)
  for got, wanted in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, wanted, atol=1e-6)


def test_enable_lora_after_sharding_is_refused():
  """`enable_lora()` on the model after sharding it: its LoRA weights had
  no owner, and the step failed with a bare `KeyError` deep in TF."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8,
                                                                  name="a"),
                            keras.layers.Dense(2, name="b")], name="seq")
  sharded = zero.ShardedModel(model, tfmgpu.list_devices("CPU")[:2], stage=3)
  model.get_layer("a").enable_lora(2)
  said = (r"model '.*' was sharded into ShardedModel '.*_zero3' and then had "
          r"weights added or removed: 2 added \(seq/a/lora_kernel_a, "
          r"seq/a/lora_kernel_b\).*Call enable_lora\(\) .*before "
          r"placing it, or shard it again")
  with pytest.raises(ValueError, match=said):
    Trainer(sharded, optimizer="sgd")
  with pytest.raises(ValueError, match=said):
    sharded.compile(optimizer="sgd", loss="mse")
  # Sharded again, it trains the LoRA factors, not the frozen kernel.
  again = zero.ShardedModel(model, tfmgpu.list_devices("CPU")[:2], stage=3)
  kernel = next(v for v in model.weights if v.path == "seq/a/kernel")
  base = kernel.numpy()  # `layer.kernel` under LoRA is the merged one.
  x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
  Trainer(again, optimizer="sgd", learning_rate=0.5, verbose=0).fit(
      x, np.arange(16) % 2, global_batch_size=8, epochs=1)
  assert "seq/a/lora_kernel_b" in {
      v.path for v in again.trainable_variables}
  np.testing.assert_array_equal(kernel.numpy(), base)


def _seeded_dropout_net():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((4,))
  h = keras.layers.Dense(8, name="d1")(inputs)
  h = keras.layers.Dropout(0.5, seed=7, name="drop")(h)
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


def test_seed_states_travel_with_the_weights():
  """`copy_weights_to` and `load_from` of a ShardedModel moved the weights
  only: a seeded Dropout copied out (or in) drew the config's first masks
  again, while the other layouts carry the seed states along."""
  devices = tfmgpu.list_devices("CPU")[:2]
  x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
  sharded = zero.ShardedModel(_seeded_dropout_net(), devices, stage=1)
  sharded.compile(optimizer="sgd", loss="mse")
  sharded.fit(x, np.zeros((8, 2), np.float32), batch_size=4, verbose=0)
  out = _seeded_dropout_net()
  sharded.copy_weights_to(out)
  np.testing.assert_array_equal(
      out(x, training=True), sharded.unsplit(x, training=True))
  source = _seeded_dropout_net()
  source(x, training=True)  # Its Dropout draws its first masks.
  again = zero.ShardedModel(_seeded_dropout_net(), devices, stage=1)
  again.load_from(source)
  np.testing.assert_array_equal(
      again.unsplit(x, training=True), source(x, training=True))
