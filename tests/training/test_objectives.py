"""Losses and metrics as Keras takes them (`tfmgpu.training.objectives`)."""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu.training import objectives
from tfmgpu.training import step as step_lib


def _two_outputs(as_dict):
  i = keras.Input((3,))
  a, b = keras.layers.Dense(2, name="a")(i), keras.layers.Dense(1, name="b")(i)
  return keras.Model(i, {"score": a, "value": b} if as_dict else [a, b])


def test_weights_shaped_batch_by_one_weigh_each_example_like_keras():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  objective = objectives.Objective(model, "mse")
  y = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
  pred = np.zeros((4, 1), np.float32)
  sw = np.array([[1.0], [0.0], [0.0], [0.0]], np.float32)
  got = objective.per_example_loss(y, pred, sw).numpy()
  np.testing.assert_allclose(got, [1.0, 0.0, 0.0, 0.0])
  want = keras.losses.MeanSquaredError()(y, pred, sample_weight=sw)
  assert float(np.mean(got)) == pytest.approx(float(want))


def test_dict_outputs_are_keyed_by_their_dict_keys_and_none_means_no_loss():
  model = _two_outputs(as_dict=True)
  objective = objectives.Objective(
      model, {"score": keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), "value": "mse"}, metrics={"value": ["mae"]})
  assert objective.metric_names == ["score_loss", "value_loss", "value_mae"]
  listed = objectives.Objective(_two_outputs(as_dict=False), ["mse", None])
  assert listed.outputs[1].loss_fn is None


def test_lists_for_dict_outputs_follow_keras_order_not_the_dicts():
  """A new user's trial: with outputs `{"zeta": ..., "alpha": ...}`,
  `loss_weights=[1, 0]` weighted the heads in the dict's order where
  Keras' is sorted (`output_names`), and trained the other head, silently;
  a list `loss` put `mse` on the logits. Both now as Keras' compile."""
  i = keras.Input((3,))
  heads = {"zeta": keras.layers.Dense(2, name="zeta")(i),
           "alpha": keras.layers.Dense(1, name="alpha")(i)}
  for kind in (dict, collections.OrderedDict):  # Keras: sorted, as written.
    _check_list_order(keras.Model(i, kind(heads)))


def _check_list_order(model):
  by_name = {"zeta": keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), "alpha": "mse"}
  losses = [[by_name[n] for n in model.output_names]]
  if type(model.output) is dict:  # pylint: disable=unidiomatic-typecheck
    losses.append(by_name)  # Keras' compile_utils: not with an OrderedDict.
  as_model = lambda d: type(model.output)(  # What the model returns.
      (n, tf.constant(d[n])) for n in model.output_names)
  y = as_model({"zeta": np.array([0, 1, 1, 0]),
                "alpha": np.array([[0.5], [1.0], [-1.0], [2.0]], np.float32)})
  pred = as_model({
      "zeta": np.array([[1, 0], [0, 2], [1, 1], [3, 0]], np.float32),
      "alpha": np.array([[0.0], [1.5], [1.0], [2.0]], np.float32)})
  for loss in losses:
    objective = objectives.Objective(model, loss, loss_weights=[1.0, 0.25])
    assert [o.name for o in objective.outputs] == model.output_names
    model.compile(loss=loss, loss_weights=[1.0, 0.25])
    want = model.compute_loss(y=y, y_pred=pred)
    got = np.mean(objective.per_example_loss(y, pred))
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_a_losss_own_error_on_equal_shapes_is_left_as_it_is():
  """The review: a loss of one's own failing inside (a matmul) on labels
  shaped like the output was said as labels it "cannot compare"."""
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
  objective = objectives.Objective(
      model, lambda y, p: tf.matmul(y, p) + 0.0 * tf.reduce_sum(p))
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as raised:
    objective.per_example_loss(np.zeros((4, 3), np.float32),
                               np.zeros((4, 3), np.float32))
  assert "cannot compare" not in str(raised.value)


def test_a_loss_returning_a_scalar_is_refused_by_name():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  objective = objectives.Objective(model, lambda y, p: tf.reduce_mean(p - y))
  with pytest.raises(ValueError, match="returned a scalar; it must return one "
                     "loss per example"):
    objective.per_example_loss(np.zeros((3, 1), np.float32),
                               np.zeros((3, 1), np.float32))


def test_a_loss_function_gets_labels_of_its_outputs_rank_as_in_keras():
  """(N,) labels against an (N, 1) output reached a user's loss function
  as they were, broadcast to (N, N) inside it: it trained on every row
  against every other, silently (a new user's trial). Keras' compile makes
  the ranks agree first; so does the Trainer now."""
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

  def absolute(y_true, y_pred):
    return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1)
  objective = objectives.Objective(model, absolute)
  pred = np.array([[1.0], [2.0], [4.0]], np.float32)
  flat = objective.per_example_loss(np.array([1.0, 2.0, 3.0], np.float32),
                                    pred).numpy()
  column = objective.per_example_loss(
      np.array([[1.0], [2.0], [3.0]], np.float32), pred).numpy()
  np.testing.assert_allclose(flat, [0.0, 0.0, 1.0])
  np.testing.assert_array_equal(flat, column)
  compiled = keras.losses.get("mae")  # What Keras' fit gives for both.
  np.testing.assert_allclose(compiled(np.array([1.0, 2.0, 3.0]), pred),
                             flat)


@pytest.mark.parametrize("loss", ["mse", keras.losses.MeanAbsoluteError()])
def test_labels_a_loss_cannot_compare_with_the_output_are_named(loss):
  """Found this session: `--loss=mse` on a two-head model with class
  indices failed with TF's `Sub` node shapes under a page of frames; the
  error now names the loss, the output, both shapes and what fits."""
  objective = objectives.Objective(_two_outputs(as_dict=True), loss)
  labels = {"score": np.array([1, 0, 1]), "value": np.zeros((3, 1))}
  outputs = {"score": np.zeros((3, 2), np.float32),
             "value": np.zeros((3, 1), np.float32)}
  for traced in (False, True):  # TF says it as a kernel or a shape error.
    call = (tf.function(objective.per_example_loss) if traced
            else objective.per_example_loss)
    with pytest.raises(ValueError, match=(
        r"loss '(mean_squared_error|mean_absolute_error)' cannot compare the "
        r"labels of output 'score', shaped \[3\], with the model's output, "
        r"shaped \[3, 2\]\. Class indices .* take sparse categorical "
        r"cross-entropy .* TF said: .*\[3\](, | vs. )\[3,2\]")):
      call(labels, outputs)


@pytest.mark.parametrize("labels,outputs,match", [
    (np.zeros((4,), np.int32), np.zeros((4, 6, 12), np.float32),
     r"The model gives logits per position \(a sequence model"),
    (np.zeros((4, 6), np.int32), np.zeros((4, 12), np.float32),
     r"The data gives a label per position \(token data\)"),
    (np.eye(12, dtype=np.float32)[:4], np.zeros((4, 12), np.float32),
     r"Labels shaped like the output \(one-hot rows\) take categorical "
     r"cross-entropy")])
def test_a_sequence_model_on_per_example_labels_and_back_is_named(
    labels, outputs, match):
  """Found this session: gpt on stdlib_modules, bert on stdlib_text said
  only Keras' "Argument `output` must have rank (ndim) `target.ndim - 1`"."""
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(12)])
  objective = objectives.Objective(model)
  with pytest.raises(ValueError, match=r"^the default loss \(sparse "
                     r"categorical cross-entropy\) cannot compare the labels "
                     r".* " + match):
    objective.per_example_loss(labels, outputs)


@pytest.mark.parametrize("loss,message", [
    (keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                ignore_class=0),
     "ignore_class=0, which Keras averages over the targets"),
    (keras.losses.MeanSquaredError(reduction="sum"),
     "reduction='sum'; tfmgpu's Trainer averages"),
    (keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
     "reduction='mean_with_sample_weight'"),
])
def test_a_loss_keras_reduces_by_another_count_is_refused(loss, message):
  """They trained silently off Keras (4.6e-2, 2.0e-1, 4.8e-2 in 3 steps):
  the step averaged every example over the batch regardless."""
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
  with pytest.raises(ValueError, match=re.escape(message)):
    objectives.Objective(model, loss)


def test_an_output_with_a_keras_mask_is_refused_in_the_step():
  """Keras averages over the unmasked tokens; the step took them all."""
  model = keras.Sequential([keras.Input((4,)), keras.layers.Embedding(
      5, 3, mask_zero=True), keras.layers.Dense(5)])
  objective = objectives.Objective(model, keras.losses.
                                   SparseCategoricalCrossentropy(
                                       from_logits=True))
  x = np.array([[1, 2, 0, 0], [3, 0, 0, 0]])
  with pytest.raises(ValueError, match="carries a Keras mask"):
    objective.per_example_loss(x, model(x))


@pytest.mark.parametrize("layout", ["staged", "pipelined"])
def test_a_split_models_output_is_named_as_the_users_layer(layout):
  """A staged or pipelined model's one output was named 'output': the
  masked-loss refusal named no layer of the user's, and a loss keyed by the
  output layer's name (as Keras keys it) did not match."""
  from tfmgpu.parallel import pipeline  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import staged  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((4,))
  h = keras.layers.Embedding(5, 3, mask_zero=True)(inputs)
  h = keras.layers.Dense(4, name="hidden")(h)
  model = keras.Model(inputs, keras.layers.Dense(5, name="tags")(h))
  split = (staged.StagedModel.from_model(model, num_stages=2)
           if layout == "staged" else pipeline.PipelinedModel.from_model(
               model, num_stages=2, micro_batches=2))
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  objective = objectives.Objective(split, {"tags": loss})
  x = np.array([[1, 2, 0, 0], [3, 0, 0, 0]])
  with pytest.raises(ValueError, match="output 'tags' carries a Keras mask"):
    objective.per_example_loss(x, model(x))


def test_evaluation_loss_includes_regularisation_like_keras():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
      2, kernel_regularizer=keras.regularizers.L2(0.1))])
  x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  y = np.array([0, 1, 1, 0, 1])
  out = step_lib.make_eval_step(model)(x, y, np.ones(5, np.float32))
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  want = model.evaluate(x, y, batch_size=5, verbose=0)
  assert float(out["loss_sum"]) / 5 == pytest.approx(want, rel=1e-5)


def test_padding_rows_stay_out_of_metrics_of_outputs_without_weights():
  model = _two_outputs(as_dict=False)
  objective = objectives.Objective(model, ["mse", "mse"], metrics=["mae"])
  y = [np.ones((2, 2), np.float32), np.ones((2, 1), np.float32)]
  pred = [np.zeros((2, 2), np.float32), np.zeros((2, 1), np.float32)]
  mask = tf.constant([1.0, 0.0])
  deltas = objective.metric_updates(y, pred, [np.ones(2, np.float32), None],
                                    mask=mask)
  counts = {k: float(v) for k, v in deltas.items() if k.endswith("/1")}
  assert counts == {"metric/a_mae/1": 1.0, "metric/b_mae/1": 1.0,
                    "metric/a_loss/1": 1.0, "metric/b_loss/1": 1.0}


@pytest.mark.parametrize("y_true, y_pred, want", [
    ([[1.0], [0.0]], [[0.9], [0.8]], 0.5),            # One unit: binary.
    ([[0, 1], [1, 0]], [[0.2, 0.8], [0.3, 0.7]], 0.5),  # One-hot targets.
    ([1, 1], [[0.2, 0.8], [0.3, 0.7]], 1.0),            # Class indices.
])
def test_accuracy_with_a_custom_loss_is_read_from_the_shapes(y_true, y_pred,
                                                              want):
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
  objective = objectives.Objective(model, lambda y, p: tf.reduce_mean(
      tf.square(tf.cast(y, tf.float32) - p), axis=-1), metrics=["accuracy"])
  deltas = objective.metric_updates(np.array(y_true, np.float32),
                                    np.array(y_pred, np.float32))
  assert objective.results(deltas)["accuracy"] == pytest.approx(want)


def test_a_metric_giving_several_numbers_is_refused_when_built():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
  with pytest.raises(ValueError, match=r"'f1_score' \(F1Score\) gives \(3,\) "
                     r"values, not one number.*F1Score\(average='micro', 'macro' or "
                     r"'weighted'\)"):
    objectives.Objective(model, "categorical_crossentropy",
                         metrics=[keras.metrics.F1Score()])


def _f1_model():
  keras.utils.set_random_seed(0)
  i = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh", name="hidden")(i)
  return keras.Model(i, keras.layers.Dense(1, name="logit")(h), name="f1_net")


@pytest.mark.parametrize("layout", ["plain", "pipelined", "zero"])
def test_f1_score_of_one_unit_on_any_placement_is_keras_value(layout):
  """F1Score (average=None) of a 1-unit output: Keras logs [0.19]; the
  Trainer failed after the first epoch (numpy's 'only 0-dimensional
  arrays ...'). On a PipelinedModel or ZeRO ShardedModel any F1Score was
  refused as 'the model's output shape is unknown'."""
  from tfmgpu.parallel import PipelinedModel  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 6)).astype(np.float32)
  y = (x[:, :1] > 0).astype(np.float32)
  specs = lambda: dict(  # pylint: disable=unnecessary-lambda-assignment
      loss=keras.losses.BinaryCrossentropy(from_logits=True),
      metrics=[keras.metrics.F1Score(threshold=0.5)])
  reference = _f1_model()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), **specs())
  want = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
  model = _f1_model()
  devices = tf.config.list_logical_devices("CPU")[:2]
  if layout == "pipelined":
    model = PipelinedModel.from_model(model, num_stages=2, micro_batches=2,
                                      devices=[d.name for d in devices])
  elif layout == "zero":
    model = zero.ShardedModel(model, [d.name for d in devices], stage=1)
  got = Trainer(model, optimizer=keras.optimizers.SGD(0.1), verbose=0,
                **specs()).fit(x, y, global_batch_size=8,
                               shuffle=False).history
  assert isinstance(got["f1_score"][0], float)
  assert got["f1_score"][0] == pytest.approx(float(want["f1_score"][0][0]),
                                             rel=1e-5)
  assert got["loss"][0] == pytest.approx(want["loss"][0], rel=1e-5)


def test_a_metric_that_builds_its_state_on_first_use_is_built_up_front():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
  objective = objectives.Objective(
      model, "categorical_crossentropy",
      metrics=[keras.metrics.F1Score(average="macro", threshold=0.5)])
  y = np.eye(3, dtype=np.float32)
  deltas = objective.metric_updates(y, y)  # Perfect predictions.
  assert objective.results(deltas)["f1_score"] == pytest.approx(1.0)


def test_sample_weights_reach_weighted_metrics_only_as_in_keras():
  """Keras' `metrics` ignore sample weights, `weighted_metrics` use them
  (a name in both is reported as `weighted_<name>`), and each output's
  loss is logged (before its loss weight); evaluated on 2 replicas with a
  padded last batch, equal to Keras on one batch of every row (Keras
  averages an output's loss over batches, not rows)."""
  import tfmgpu  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(37, 3)).astype(np.float32)
  y = {"score": rng.integers(0, 2, 37), "value": rng.normal(size=(37, 1))}
  sw = np.linspace(0.0, 2.0, 37).astype(np.float32)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    model = _two_outputs(as_dict=True)
  specs = dict(
      loss={"score": keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), "value": "mse"},
      loss_weights={"score": 0.5, "value": 2.0},
      metrics={"score": ["accuracy"], "value": ["mae"]},
      weighted_metrics={"score": ["accuracy"], "value": ["mse"]})
  got = Trainer(model, strategy=strategy, verbose=0, **specs).evaluate(
      x, y, sample_weight=sw, global_batch_size=8)
  reference = _two_outputs(as_dict=True)
  reference.set_weights(model.get_weights())
  reference.compile(**specs)
  want = reference.evaluate(x, y, sample_weight=sw, batch_size=37,
                            verbose=0, return_dict=True)
  names = {"loss", "score_loss", "score_accuracy", "score_weighted_accuracy",
           "value_loss", "value_mae", "value_mse"}
  assert names <= set(got) and names == set(want)
  for name in names:
    assert got[name] == pytest.approx(want[name], rel=1e-5), name
  assert got["score_accuracy"] != pytest.approx(got["score_weighted_accuracy"])


def test_one_output_takes_a_one_entry_list_or_a_dict_by_its_name_as_keras():
  """`loss_weights=[0.25]` on a one-output model: Keras trains, the Trainer
  raised "float() argument must be ... not 'list'"."""
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 4)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2,
                                                                   name="out")])

  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=[loss],
                    loss_weights=[0.25])
  reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  for specs in (dict(loss=loss, loss_weights=[0.25]),
                dict(loss=[loss], loss_weights=(0.25,)),
                dict(loss={"out": loss}, loss_weights={"out": 0.25})):
    model = build()
    Trainer(model, optimizer=keras.optimizers.SGD(0.5), verbose=0,
            **specs).fit(x, y, global_batch_size=8, shuffle=False)
    for got, want in zip(model.get_weights(), reference.get_weights()):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"loss_weights=\[0.25, 1.0\] has 2 "
                     r"entries for the model's one output.*'out'"):
    objectives.Objective(build(), loss, loss_weights=[0.25, 1.0])


def _float64_model():
  keras.utils.set_random_seed(0)
  i = keras.Input((6,))
  h = keras.layers.Dense(16, activation="tanh", name="hidden",
                         kernel_regularizer=keras.regularizers.L2(1e-2))(i)
  return keras.Model(i, keras.layers.Dense(3, name="logits")(h))


@pytest.mark.parametrize("layout", ["plain", "mirrored", "staged",
                                    "pipelined", "zero"])
def test_a_float64_model_trains_in_float64_as_keras_does(float64_keras,
                                                         layout):
  """Keras computes a float64 model's loss (and regularisation) in its
  floatx, float64; the Trainer cast them to float32: weights 1.4e-9 off
  Keras' after one epoch of a tiny model (0.027 for MobileNetV2 in 3
  steps), on every placement."""
  from tfmgpu import strategies  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import PipelinedModel  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import StagedModel  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import placed_model  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import zero  # pylint: disable=g-import-not-at-top
  from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(32, 6)), rng.integers(0, 3, 32).astype("int32")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  reference = _float64_model()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
  reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
  strategy = (strategies.get_strategy("mirrored", num_replicas=2)
              if layout == "mirrored" else tf.distribute.get_strategy())
  with strategy.scope():
    model = _float64_model()
  placed = {
      "staged": lambda: StagedModel(model, partition.plan_stages(
          model, 2, split_points=["logits"], devices=devices)),
      "pipelined": lambda: PipelinedModel.from_model(
          model, num_stages=2, micro_batches=2, devices=devices),
      "zero": lambda: zero.ShardedModel(model, devices, stage=1),
  }.get(layout, lambda: model)()
  trainer = Trainer(placed, strategy=strategy, loss=loss, verbose=0,
                    optimizer=keras.optimizers.SGD(0.1))
  trainer.fit(x, y, global_batch_size=16, shuffle=False)
  assert trainer.evaluate(x[:30], y[:30], global_batch_size=16)[
      "loss"] == pytest.approx(reference.evaluate(x[:30], y[:30], verbose=0),
                               rel=1e-6)  # The last batch padded.
  got = placed_model.unsplit_of(placed)
  for w, r in zip(got.weights, reference.weights):
    assert w.dtype == "float64"
    np.testing.assert_allclose(np.asarray(w), np.asarray(r), rtol=0,
                               atol=1e-12, err_msg=w.path)
