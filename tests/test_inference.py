"""Multi-device inference: every placement gives single-device predictions."""

import re
import subprocess
import sys
import textwrap

from absl.testing import flagsaver
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import devices as tfmgpu_devices
from tfmgpu import inference, models
from tfmgpu.parallel import branches, partition, staged

ROWS = 1001  # Not a multiple of any batch size or replica count used here.


@pytest.fixture(scope="module")
def rows(digits_arrays):
  return digits_arrays.x_train[:ROWS]


@pytest.fixture(scope="module")
def model():
  return models.build_model("convnet", input_shape=(28, 28, 1),
                            num_classes=10, seed=1)


@pytest.fixture(scope="module")
def reference(model, rows):
  return model.predict(rows, batch_size=128, verbose=0)


@pytest.mark.parametrize("strategy", [
    "default", "one_device",
    pytest.param(lambda: tfmgpu.get_strategy("mirrored", num_replicas=2),
                 id="mirrored2"),
    pytest.param(lambda: tfmgpu.get_strategy("mirrored", num_replicas=4),
                 id="mirrored4"),
])
@pytest.mark.parametrize("batch_size,steps_per_execution", [(64, 1), (96, 4)])
def test_data_parallel_equals_single_device(model, rows, reference, strategy,
                                            batch_size, steps_per_execution):
  strategy = strategy() if callable(strategy) else strategy
  got = inference.predict(model, rows, strategy=strategy, batch_size=batch_size,
                          steps_per_execution=steps_per_execution)
  assert got.shape == (ROWS, 10) and got.dtype == np.float32
  np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", [
    "default",
    pytest.param(lambda: tfmgpu.get_strategy("mirrored", num_replicas=2),
                 id="mirrored2"),
    pytest.param(lambda: tfmgpu.get_strategy("mirrored", num_replicas=4),
                 id="mirrored4"),
])
def test_requests_smaller_than_a_batch_are_served_in_one_call(
    model, rows, reference, strategy):
  # Online serving: 1, 3 and 7 rows (not multiples of the replica count)
  # are split over the replicas without an input pipeline.
  strategy = strategy() if callable(strategy) else strategy
  predictor = inference.Predictor(model, strategy=strategy, batch_size=64)
  for n in (1, 3, 7):
    got = predictor.predict(rows[:n])
    assert got.shape == (n, 10)
    np.testing.assert_allclose(got, reference[:n], rtol=1e-5, atol=1e-5)
  assert predictor._fn.experimental_get_tracing_count() == 0  # pylint: disable=protected-access


def test_prefetch_off_gives_the_same_predictions(model, rows, reference):
  predictor = inference.Predictor(
      model, strategy=tfmgpu.get_strategy("mirrored", num_replicas=2),
      batch_size=64, prefetch=False)
  np.testing.assert_allclose(predictor.predict(rows), reference, rtol=1e-5,
                             atol=1e-5)


def test_model_built_in_strategy_scope_is_used_in_place(rows, reference, model):
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=4)
  with strategy.scope():
    replicated = keras.models.clone_model(model)
    replicated.set_weights(model.get_weights())
  predictor = inference.Predictor(replicated, batch_size=64)
  assert predictor.runner is replicated  # No copy: its own strategy.
  assert predictor.strategy.num_replicas_in_sync == 4
  np.testing.assert_allclose(predictor.predict(rows), reference, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("serve_replicas", [2, 4])
def test_model_built_under_another_strategy_is_served(rows, reference, model,
                                                      serve_replicas):
  # The README's sequence: built in one strategy's scope, served under a new
  # strategy object (TF refuses to read the weights inside the new scope).
  with tfmgpu.get_strategy("mirrored", num_replicas=2).scope():
    built = keras.models.clone_model(model)
    built.set_weights(model.get_weights())
  serving = tfmgpu.get_strategy("mirrored", num_replicas=serve_replicas)
  predictor = inference.Predictor(built, strategy=serving, batch_size=64)
  assert predictor.runner is not built
  assert predictor.strategy.num_replicas_in_sync == serve_replicas
  np.testing.assert_allclose(predictor.predict(rows), reference, rtol=1e-5,
                             atol=1e-5)

class _Mlp(keras.Model):
  """A subclassed model whose config rebuilds it (Keras' default)."""

  def __init__(self, units=8, scale=1.0, **kwargs):
    super().__init__(**kwargs)
    self.units, self.scale = units, scale
    self.hidden = keras.layers.Dense(units, activation="relu")
    self.out = keras.layers.Dense(3)

  def call(self, x):
    return self.out(self.hidden(x)) * self.scale


class _Wrapped(_Mlp):
  """A subclassed model taking a layer: its config cannot rebuild it."""

  def __init__(self, head, **kwargs):
    super().__init__(**kwargs)
    self.out = head


def test_a_subclassed_model_is_served_under_a_new_strategy():
  """A new user's trial: `tfmgpu.predict(subclassed, x, strategy=
  "mirrored")` failed with Keras' "Arguments 'clone_function' and
  'input_tensors' are only supported for Sequential models or Functional
  models"; it is copied by its config now, or refused saying what to do."""
  x = np.random.default_rng(0).normal(size=(37, 5)).astype("float32")
  model = _Mlp(name="sub")
  want = model.predict(x, verbose=0)
  got = tfmgpu.predict(model, x, batch_size=8,
                       strategy=tfmgpu.get_strategy("mirrored",
                                                    num_replicas=2))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  model.scale = 2.0  # Not what its config rebuilds: refused, not served.
  with pytest.raises(ValueError, match=r"its copy differs in scale=2\.0 "
                     r"\(copy: 1\.0\)"):
    tfmgpu.predict(model, x, strategy=tfmgpu.get_strategy(
        "mirrored", num_replicas=2))
  wrapped = _Wrapped(keras.layers.Dense(3), name="wrapped")
  wrapped.predict(x, verbose=0)
  with pytest.raises(ValueError, match=r"model 'wrapped' \(_Wrapped, a "
                     r"subclassed keras.Model\) must be copied here .* pass "
                     r"that strategy object \(strategy=s, not a name"):
    tfmgpu.predict(wrapped, x, strategy=tfmgpu.get_strategy(
        "mirrored", num_replicas=2))


@pytest.mark.parametrize("num_stages", [2, 4])
def test_model_parallel_equals_single_device(model, rows, reference, num_stages):
  split = staged.StagedModel(model, partition.plan_stages(model, num_stages))
  got = inference.predict(split, rows, batch_size=64)
  np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_pipeline_streams_micro_batches_to_the_same_predictions(
    model, rows, reference, micro_batches):
  from tfmgpu.parallel import pipeline
  piped = pipeline.PipelinedModel(model, partition.plan_stages(model, 2),
                                  micro_batches=micro_batches)
  got = inference.predict(piped, rows, batch_size=64)
  np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
  few = inference.predict(piped, rows[:5], batch_size=64)  # One call.
  np.testing.assert_allclose(few, reference[:5], rtol=1e-5, atol=1e-5)


def test_branch_parallel_equals_members_one_after_the_other(rows, model):
  other = models.build_model("convnet", input_shape=(28, 28, 1),
                             num_classes=10, seed=2)
  side_by_side = branches.BranchParallel([model, other], combine="mean")
  expected = (model.predict(rows, verbose=0) + other.predict(rows, verbose=0)) / 2
  got = inference.predict(side_by_side, rows, batch_size=64)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_reduced_precision_outputs_float32(model, rows, reference):
  got = inference.predict(model, rows, strategy="mirrored", precision="bfloat16")
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, reference, atol=0.05)
  assert np.mean(np.argmax(got, -1) == np.argmax(reference, -1)) > 0.98


def test_copies_serve_todays_weights_ids_and_integer_outputs():
  """Found by a new user: `predict(strategy="mirrored")` (a copy in the
  strategy's scope) kept serving the first call's weights after training;
  `precision="bfloat16"` rounded token ids (301 read row 300); integer
  outputs came back as float32 (987654321 as 987654336); a Lambda layer
  could not be copied ("deserialization of a Lambda layer")."""
  ids = keras.Input((1,), dtype="int32", name="ids")
  rows = keras.layers.Flatten()(keras.layers.Embedding(5000, 1, name="emb")(ids))
  doubled = keras.layers.Lambda(lambda t: t * 2.0, name="double")(rows)
  model = keras.Model(ids, {"value": doubled, "id": keras.ops.cast(
      ids, "int64") * 1_000_000_007})
  table = np.zeros((5000, 1), "float32")
  table[[301, 1001, 4097]] = [[1], [2], [3]]
  model.get_layer("emb").set_weights([table])
  x = np.array([[301], [1001], [4097]], "int32")
  for precision in ("float32", "bfloat16"):
    got = inference.predict(model, x, strategy="mirrored", precision=precision)
    np.testing.assert_array_equal(got["value"].ravel(), [2, 4, 6])
    assert got["id"].dtype == np.int64
    assert got["id"].ravel().tolist() == [301_000_002_107, 1_001_000_007_007,
                                          4_097_000_028_679]
  model.get_layer("emb").set_weights([table * 10])  # "Trained" since.
  got = inference.predict(model, x, strategy="mirrored")
  np.testing.assert_array_equal(got["value"].ravel(), [20, 40, 60])


def test_predict_leaves_the_callers_arrays_as_they_were():
  """Found by a new user: a mirrored predict over several batches wrote
  the model's first op's result (here x - 3) over the caller's `x`: TF
  takes an aligned numpy array a generator yields without copying it, and
  the batches were views of `x`. 64-byte aligned here, as a quarter of
  small numpy arrays happen to be."""
  raw = np.zeros(64 * 16 * 4 + 64, np.uint8)
  start = (-raw.ctypes.data) % 64
  x = raw[start:start + 64 * 16 * 4].view(np.float32).reshape(64, 16)
  x[:] = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
  given = x.copy()
  inputs = keras.Input((16,))
  model = keras.Model(inputs, keras.layers.Lambda(lambda t: t - 3.0)(inputs))
  got = inference.predict(model, x, strategy=tfmgpu.get_strategy(
      "mirrored", num_replicas=2), batch_size=8)
  np.testing.assert_array_equal(x, given)
  np.testing.assert_array_equal(got, given - 3.0)


def test_zero_rows_give_every_output_with_zero_rows():
  """Found by a new user: 0 rows gave a dict-output model a bare array, a
  two-output model a TypeError, and a StagedModel or PipelinedModel an
  AttributeError ('output_shape'). Keras' own predict fails on 0 rows;
  the structure, shapes and dtypes are those of a predict on rows."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((4,), name="x")
  h = keras.layers.Dense(5, name="h")(inputs)
  scores = keras.layers.Dense(3, name="scores")(h)
  ids = keras.layers.Lambda(lambda t: keras.ops.argmax(t, -1), name="ids")(
      scores)
  single = keras.Model(inputs, scores)
  models_ = [single, keras.Model(inputs, {"o": scores}),
             keras.Model(inputs, [scores, keras.layers.Dense(1)(h), ids]),
             staged.StagedModel(single, partition.plan_stages(single, 2)),
             tfmgpu.PipelinedModel(single, partition.plan_stages(single, 2),
                                   micro_batches=2)]
  for model in models_:
    want = inference.predict(model, np.ones((2, 4), "float32"))
    got = inference.predict(model, np.zeros((0, 4), "float32"))
    tf.nest.assert_same_structure(got, want)
    assert [(type(a), a.shape, a.dtype) for a in tf.nest.flatten(got)] == [
        (np.ndarray, (0, *a.shape[1:]), a.dtype)
        for a in tf.nest.flatten(want)], model.name


def test_train_split_serve_unsplit_and_the_reverse(tmp_path, rows):
  x, y = rows[:128], np.arange(128) % 10
  unsplit = models.build_model("deep_mlp", input_shape=(28, 28, 1),
                               num_classes=10, seed=0, depth=4, width=32)
  split = staged.StagedModel(unsplit, partition.plan_stages(unsplit, 2))
  split.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  split.fit(x, y, batch_size=32, epochs=1, verbose=0)
  trained = inference.predict(split, rows)
  path = str(tmp_path / "served.keras")
  split.to_unsplit().save(path)
  served = inference.load_model(path)
  np.testing.assert_allclose(inference.predict(served, rows), trained,
                             rtol=1e-5, atol=1e-5)
  # The reverse: an unsplit model served split.
  resplit = staged.StagedModel(served, partition.plan_stages(served, 4))
  np.testing.assert_allclose(inference.predict(resplit, rows), trained,
                             rtol=1e-5, atol=1e-5)


def test_saved_model_loads_in_plain_tensorflow(tmp_path, model, rows, reference):
  path = inference.export_saved_model(model, str(tmp_path / "sm"))
  np.save(tmp_path / "x.npy", rows[:7])
  code = textwrap.dedent(f"""
      import sys, numpy as np, tensorflow as tf
      loaded = tf.saved_model.load({path!r})
      out = loaded.serve(tf.constant(np.load({str(tmp_path / 'x.npy')!r})))
      assert "tfmgpu" not in sys.modules
      np.save({str(tmp_path / 'out.npy')!r}, out.numpy())
  """)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=180, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  np.testing.assert_allclose(np.load(tmp_path / "out.npy"), reference[:7],
                             rtol=1e-5, atol=1e-5)
  # And through tfmgpu's own loader.
  np.testing.assert_allclose(
      inference.predict(inference.load_model(path), rows), reference,
      rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_file_or_shapes(tmp_path, model, rows):
  with pytest.raises(FileNotFoundError, match=r"model_path='.*missing.keras' "
                     r"does not exist"):
    inference.load_model(str(tmp_path / "missing.keras"))
  other = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10)
  wrong = str(tmp_path / "mlp.weights.h5")
  other.save_weights(wrong)
  with pytest.raises(ValueError, match=r"weights file '.*mlp.weights.h5' does "
                     r"not match model 'convnet'"):
    inference.load_weights(keras.models.clone_model(model), wrong)
  with pytest.raises(ValueError, match=r"data rows have shape \(8, 8, 1\) but "
                     r"model 'convnet' expects \(28, 28, 1\)"):
    inference.predict(model, np.zeros((5, 8, 8, 1), np.float32))
  with pytest.raises(ValueError, match=r"^batch_size=0 must be >= 1\.$"):
    inference.Predictor(model, batch_size=0)
  # Split models too (a pipeline's error came from its graph, 19 lines,
  # naming a micro-batch's shape).
  split = staged.StagedModel.from_model(model, num_stages=2)
  with pytest.raises(ValueError, match=r"data rows have shape \(8, 8, 1\) but "
                     r"model '.*' expects \(28, 28, 1\)"):
    inference.predict(split, np.zeros((5, 8, 8, 1), np.float32))


class _RowMean(keras.layers.Layer):
  """Each ragged row's mean (a model Keras' predict feeds a RaggedTensor)."""

  def call(self, rows):
    return tf.reduce_mean(tf.cast(rows, tf.float32), axis=1, keepdims=True)

  def compute_output_shape(self, shape):
    return (shape[0], 1)


@pytest.mark.parametrize("strategy", [
    "default",
    pytest.param(lambda: tfmgpu.get_strategy("mirrored", num_replicas=2),
                 id="mirrored2"),
])
def test_ragged_and_sparse_inputs_predict_as_in_keras(strategy):
  """A RaggedTensor or SparseTensor given as x was refused as 'not an array
  of numbers' (Keras' predict takes both): rows in order, the last batch
  short (5 rows, batches of 2 over 2 replicas)."""
  strategy = strategy() if callable(strategy) else strategy
  ragged = tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7], [8, 9]])
  inp = keras.Input((None,), dtype="int32", ragged=True)
  mean = keras.Model(inp, _RowMean()(inp))
  got = inference.predict(mean, ragged, strategy=strategy, batch_size=2)
  np.testing.assert_allclose(got, mean.predict(ragged, verbose=0))
  np.testing.assert_allclose(got.ravel(), [1.5, 3, 5, 7, 8.5])
  sparse = tf.sparse.from_dense(np.eye(5, 10, dtype="float32") * 3)
  inp = keras.Input((10,), sparse=True)
  keras.utils.set_random_seed(0)
  dense = keras.Model(inp, keras.layers.Dense(2)(inp))
  np.testing.assert_allclose(
      inference.predict(dense, sparse, strategy=strategy, batch_size=2),
      dense.predict(sparse, verbose=0), rtol=1e-6, atol=1e-6)


def _tiny_model():
  return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_verbose_is_taken_as_keras_takes_it(capsys):
  """Found by a new user: `tfmgpu.predict(model, x, verbose=0)`, as they
  call Keras' predict, was a TypeError."""
  tiny, x = _tiny_model(), np.ones((10, 3), "float32")
  want = tiny.predict(x, verbose=0)
  for verbose in (0, 1, 2, "auto"):
    capsys.readouterr()
    got = inference.predict(tiny, x, batch_size=4, verbose=verbose)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    out = capsys.readouterr().out  # Not a terminal: one line at the end.
    assert (re.fullmatch(r"Predict: 10/10 - \d+s - examples/s: [\d,]+\n", out)
            if verbose else out == ""), (verbose, out)
  with pytest.raises(ValueError, match=r"verbose=3 is unknown. Choose one of "
                     r"0, 1, 2, auto."):
    inference.predict(tiny, x, verbose=3)


def test_a_missing_dict_input_is_named_before_anything_runs():
  """Found by a new user: a dict x without one of the model's inputs
  failed inside the traced step (12 lines; 18 for a StagedModel, ending
  in "training=False"). Keys the model does not take are ignored, as in
  Keras."""
  a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
  model = keras.Model({"a": a, "b": b}, keras.layers.Dense(2, name="out")(
      keras.layers.Concatenate()([a, b])))
  x = {"a": np.zeros((4, 3), "float32"), "b": np.ones((4, 2), "float32")}
  split = staged.StagedModel(model, partition.plan_stages(model, 2))
  for served in (model, split):
    for given in ({"a": x["a"]},
                  tf.data.Dataset.from_tensor_slices({"a": x["a"]}).batch(2)):
      with pytest.raises(ValueError, match=(
          r"^x is missing input\(s\) 'b' of model '\w+': x has keys \['a'\], "
          r"the model takes \['a', 'b'\]. Give x one array per input name.$")):
        inference.predict(served, given)
    np.testing.assert_allclose(
        inference.predict(served, dict(x, c=np.zeros((4, 1), "float32"))),
        model.predict(x, verbose=0), rtol=1e-6)


def test_run_directory_loads_its_model_keras(tmp_path, caplog):
  tiny = _tiny_model()
  tiny.save(str(tmp_path / "model.keras"))
  x = np.arange(12, dtype=np.float32).reshape(4, 3)
  with caplog.at_level("INFO", logger="absl"):
    loaded = inference.load_model(str(tmp_path))
  np.testing.assert_allclose(loaded.predict(x, verbose=0),
                             tiny.predict(x, verbose=0), rtol=1e-6)
  assert str(tmp_path / "model.keras") in caplog.text


def test_a_keras_hub_preset_directory_says_how_to_make_a_keras_file(
    tmp_path):
  """`generate --model_path=<preset>` said only "Pass a .keras file or a
  SavedModel directory"; it now says how to make one from the preset."""
  for name in ("config.json", "metadata.json", "task.json"):
    (tmp_path / name).write_text("{}")
  with pytest.raises(ValueError, match=r"model_path='.*' is a keras_hub "
                     r"preset directory; predict and generate load a .keras "
                     r"file .*CausalLM.from_preset\(.*preprocessor=None\)"
                     r"\.save\('model.keras'\).*--model_preset="):
    inference.load_model(str(tmp_path))


def test_directory_without_a_model_lists_what_it_holds(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match=r"model_path='.*empty' is a directory "
                     r"without saved_model.pb .* or model.keras .*, and it "
                     r"holds no .keras file"):
    inference.load_model(str(empty))
  branches_dir = tmp_path / "branches"
  branches_dir.mkdir()
  for i in (0, 1):
    _tiny_model().save(str(branches_dir / f"model.branch{i}.keras"))
  with pytest.raises(ValueError, match=r"without saved_model.pb .* or "
                     r"model.keras .*\. It holds model.branch0.keras, "
                     r"model.branch1.keras; .* comma-separated with "
                     r"--strategy=branch_parallel, e.g. --model_path="
                     r".*branch0.keras,.*branch1.keras"):
    inference.load_model(str(branches_dir))
  # The run's model.keras asked for (a branch run saves none): the same.
  with pytest.raises(ValueError, match=r"It holds model.branch0.keras, "
                     r"model.branch1.keras; .*--strategy=branch_parallel"):
    inference.load_model(str(branches_dir / "model.keras"))
  other = tmp_path / "other"
  other.mkdir()
  _tiny_model().save(str(other / "best.keras"))
  with pytest.raises(ValueError, match=r"It holds best.keras; pass one of "
                     r"them as the model path"):
    inference.load_model(str(other))

def test_cli_serves_a_trained_model(tmp_path, model, parsed_flags, capsys,
                                    digits_arrays):
  from tfmgpu import predict
  path = str(tmp_path / "m.keras")
  model.save(path)
  out = str(tmp_path / "preds.npy")
  with flagsaver.flagsaver(model_path=[path], strategy="mirrored",
                           num_replicas=2, output=out, batch_size=96):
    assert predict.main(["predict"]) == 0
  printed = capsys.readouterr().out
  assert "throughput" in printed and "accuracy" in printed
  x_test = digits_arrays.x_test
  np.testing.assert_allclose(np.load(out), model.predict(x_test, verbose=0),
                             rtol=1e-5, atol=1e-5)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_predict_gives_logits_probabilities_or_classes(model, rows, reference):
  """Issue 29 item 16: predict gave logits only."""
  got = {kind: inference.predict(model, rows[:50], output_kind=kind)
         for kind in ("logits", "probabilities", "classes")}
  np.testing.assert_allclose(got["logits"], reference[:50], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(got["probabilities"], _softmax(reference[:50]),
                             rtol=1e-5, atol=1e-6)
  assert got["classes"].dtype == np.int32
  np.testing.assert_array_equal(got["classes"], reference[:50].argmax(-1))
  probabilities = got["probabilities"]
  assert inference.convert_outputs(probabilities, "probabilities") is (
      probabilities)  # Already a softmax: kept.
  with pytest.raises(ValueError, match=r"output_kind='logit' is unknown. "
                     r"Did you mean 'logits'\? Choose one of logits, "
                     r"probabilities, classes"):
    inference.predict(model, rows[:5], output_kind="logit")
  with pytest.raises(ValueError, match=r"output_kind='classes' needs class "
                     r"scores, but the output has shape \(4, 1\)"):
    inference.convert_outputs(np.zeros((4, 1)), "classes")


@pytest.mark.parametrize("kind", ["probabilities", "classes"])
def test_cli_writes_the_output_kind_asked_for(tmp_path, model, parsed_flags,
                                              capsys, digits_arrays, kind):
  from tfmgpu import predict
  path = str(tmp_path / "m.keras")
  model.save(path)
  out = str(tmp_path / "preds.npy")
  with flagsaver.flagsaver(model_path=[path], strategy="default", output=out,
                           output_kind=kind):
    assert predict.main(["predict"]) == 0
  assert f"preds.npy ({kind})" in capsys.readouterr().out
  logits = model.predict(digits_arrays.x_test, verbose=0)
  if kind == "classes":
    np.testing.assert_array_equal(np.load(out), logits.argmax(-1))
  else:
    np.testing.assert_allclose(np.load(out), _softmax(logits), rtol=1e-5,
                               atol=1e-6)


def test_cli_failure_writes_no_output(tmp_path, model, parsed_flags, capsys):
  from tfmgpu import predict
  path = str(tmp_path / "m.keras")
  model.save(path)
  out = tmp_path / "preds.npy"
  with flagsaver.flagsaver(model_path=[path], strategy="default",
                           dataset="digits8x8", output=str(out)):
    assert predict.main(["predict"]) == 1
  assert "data rows have shape (8, 8, 1)" in capsys.readouterr().err
  assert not out.exists() and not list(tmp_path.glob("*.npy"))


def test_cli_without_model_path_is_a_usage_error(parsed_flags):
  from absl import app
  from tfmgpu import predict
  with flagsaver.flagsaver(model_path=None):
    with pytest.raises(app.UsageError, match=r"--model_path is required"):
      predict.main(["predict"])


def test_a_saved_model_is_served_on_every_replica_asked_for(tmp_path, model,
                                                            rows, reference,
                                                            cpu_devices):
  path = inference.export_saved_model(model, str(tmp_path / "sm"))
  loaded = inference.load_model(path)
  predictor = inference.Predictor(loaded, strategy="mirrored", batch_size=64)
  assert predictor.strategy.num_replicas_in_sync == len(cpu_devices)
  np.testing.assert_allclose(predictor.predict(rows), reference, rtol=1e-5,
                             atol=1e-5)
  # Each replica runs the serving function on its own device.
  concrete = predictor._fn.get_concrete_function(  # pylint: disable=protected-access
      iter(predictor.strategy.experimental_distribute_dataset(
          tf.data.Dataset.from_tensor_slices(rows).batch(64))), tf.constant(1))
  calls = {op.device for op in concrete.graph.get_operations()
           if op.type in ("StatefulPartitionedCall", "PartitionedCall")}
  assert {tfmgpu_devices.canonical_device(d) for d in calls if d} >= set(
      cpu_devices)


@pytest.mark.parametrize("outputs", ["dict", "list"])
def test_a_two_input_two_output_saved_model_serves_every_output(tmp_path,
                                                                outputs):
  a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
  h = keras.layers.Dense(4, activation="tanh")(
      keras.layers.Concatenate()([a, b]))
  heads = [keras.layers.Dense(2, name="cls")(h),
           keras.layers.Dense(1, name="val")(h)]
  two = keras.Model({"a": a, "b": b}, dict(zip(("cls", "val"), heads))
                    if outputs == "dict" else heads)
  rng = np.random.default_rng(0)
  x = {"a": rng.normal(size=(37, 5)).astype(np.float32),
       "b": rng.normal(size=(37, 3)).astype(np.float32)}
  want = two.predict(x, verbose=0)
  path = inference.export_saved_model(two, str(tmp_path / "sm"))
  # A path is loaded for the call; the rows are split over 2 replicas.
  got = tfmgpu.predict(path, x, strategy=tfmgpu.get_strategy(
      "mirrored", num_replicas=2), batch_size=8)
  assert type(got) is type(want)  # pylint: disable=unidiomatic-typecheck
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"takes the inputs \['a', 'b'\]; x is "
                     r"tuple\. Give x as a dict"):
    tfmgpu.predict(inference.load_model(path), (x["a"], x["b"]))
  served = inference.Predictor(path, batch_size=16)  # Loaded once here.
  for g, w in zip(tf.nest.flatten(served.predict(x)), tf.nest.flatten(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["model_parallel", "branch_parallel"])
def test_a_saved_model_cannot_be_split_and_says_why(tmp_path, model, strategy):
  path = inference.export_saved_model(model, str(tmp_path / "sm"))
  loaded = [inference.load_model(path)] * (2 if strategy == "branch_parallel"
                                           else 1)
  with pytest.raises(ValueError, match=rf"strategy='{strategy}' places the "
                     r"layers of a Keras model.*is a SavedModel.*Give its "
                     r".keras file.*--strategy=mirrored"):
    inference.place_for_serving(loaded, strategy)


def test_predict_cli_reads_the_dataset_of_the_run_and_fits_its_windows(
    tmp_path):
  from tfmgpu import predict as predict_cli  # pylint: disable=g-import-not-at-top
  from tfmgpu import rundir  # pylint: disable=g-import-not-at-top
  from tfmgpu.config import TrainConfig  # pylint: disable=g-import-not-at-top
  assert predict_cli._recorded_dataset(str(tmp_path))[0] == "digits"  # pylint: disable=protected-access
  rundir.write_record(str(tmp_path), rundir.record_of(
      TrainConfig(model="gpt").recorded_run))
  model_file = str(tmp_path / "model.keras")
  assert predict_cli._recorded_dataset(model_file)[0] == "stdlib_text"  # pylint: disable=protected-access
  assert predict_cli._recorded_dataset(str(tmp_path))[0] == "stdlib_text"  # pylint: disable=protected-access
  gpt = models.build_model("gpt", input_shape=(32,), num_classes=256)
  assert predict_cli._options_for_model("stdlib_text", gpt) == {"seq_len": 32}  # pylint: disable=protected-access
  assert predict_cli._options_for_model("digits", gpt) == {}  # pylint: disable=protected-access
