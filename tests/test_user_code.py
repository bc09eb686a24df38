"""The user's own code by reference: `--model=module:function` and the like.

Errors of form, module, file, name and signature come from `TrainConfig`
(and the flags) before TensorFlow loads; import-time errors from the
registries' lookups; a regression run through references reports the
user's loss and metrics, equal to Keras' `evaluate`; the README's command
trains the example module.
"""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tfmgpu import data
from tfmgpu import models
from tfmgpu import user_code
from tfmgpu.config import TrainConfig

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE = "scripts/examples/two_input.py"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")

USER_MODULE = '''
import keras
import numpy as np


def load(seed=0):
  rng = np.random.default_rng(seed)
  def split(n):
    x = {"a": rng.normal(size=(n, 3)).astype(np.float32),
         "b": rng.normal(size=(n, 2)).astype(np.float32)}
    y = (x["a"] @ [1.0, -2.0, 0.5] + x["b"] @ [0.3, 0.1]).astype(np.float32)
    return x, y[:, None]
  return split(256), split(64)


def build(input_shape, num_classes):
  assert num_classes is None  # Float targets: no classes.
  a = keras.Input(input_shape["a"], name="a")
  b = keras.Input(input_shape["b"], name="b")
  h = keras.layers.Concatenate()([a, b])
  return keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(h))


def squared_error(y_true, y_pred):
  return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def abs_error(y_true, y_pred):
  return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


def needs_more(input_shape, num_classes, depth):
  return None


def load_needs_size(size):
  return None


not_a_function = 3


def _decorate(fn):
  def wrapper(*args, **kwargs):
    return fn(*args, **kwargs)
  return wrapper


@_decorate
def decorated(x):
  return x
'''


@pytest.fixture(scope="module")
def module_file(tmp_path_factory):
  """The user's module as a file: `path/to/regression_user.py`."""
  path = tmp_path_factory.mktemp("user") / "regression_user.py"
  path.write_text(textwrap.dedent(USER_MODULE))
  return str(path)


# ---------------------------------------------- before TensorFlow: TrainConfig

@pytest.mark.parametrize("value", ["mod:", ":build", "a b:build",
                                   "mod:1build", "my-pkg.mod:build"])
def test_a_malformed_reference_shows_both_forms(value):
  with pytest.raises(ValueError, match=re.escape(
      f"model={value!r} is not a reference to your code: use "
      "'package.module:function' or 'path/to/file.py:function'")):
    TrainConfig(model=value)


def test_a_module_not_on_the_path_says_how_to_put_it_there():
  with pytest.raises(user_code.UserCodeError, match=re.escape(
      "model='no_such_pkg.nets:build': module 'no_such_pkg.nets' cannot be "
      "found (ModuleNotFoundError: No module named 'no_such_pkg'). Run from "
      "the directory that holds it, add its directory to PYTHONPATH")):
    TrainConfig(model="no_such_pkg.nets:build")
  with pytest.raises(ValueError, match=re.escape(
      "dataset='no_such_module:load': no module named 'no_such_module' on "
      "the Python path.") + ".*'path/to/no_such_module.py:load'"):
    TrainConfig(dataset="no_such_module:load")


def test_a_missing_file_is_named(tmp_path):
  missing = str(tmp_path / "nope.py")
  with pytest.raises(ValueError, match=re.escape(
      f"dataset='{missing}:load': the file {missing!r} does not exist")):
    TrainConfig(dataset=f"{missing}:load")


def test_a_name_the_file_does_not_define_lists_its_functions(module_file):
  with pytest.raises(ValueError, match=re.escape(
      f"model='{module_file}:buld': {module_file} defines no 'buld'. Its "
      "functions: abs_error, build, decorated, load, load_needs_size, "
      "needs_more, squared_error.")):
    TrainConfig(model=f"{module_file}:buld")
  with pytest.raises(ValueError, match=r"metrics='.*:mea': .* defines no "
                     r"'mea'"):
    TrainConfig(metrics=("mae", f"{module_file}:mea"))


def test_a_def_that_does_not_fit_the_call_is_refused(module_file):
  with pytest.raises(ValueError, match=re.escape(
      f"model='{module_file}:needs_more': needs_more(input_shape, "
      "num_classes, depth) cannot be called as build(input_shape, "
      "num_classes) (missing a required argument: 'depth'). Define it as "
      "`def build(input_shape, num_classes):`")):
    TrainConfig(model=f"{module_file}:needs_more")
  with pytest.raises(ValueError, match=re.escape(
      "load_needs_size(size) cannot be called as load() (missing a required "
      "argument: 'size')")):
    TrainConfig(dataset=f"{module_file}:load_needs_size")
  with pytest.raises(ValueError, match=re.escape(
      "load(seed=...) cannot be called as fn(y_true, y_pred) (too many "
      "positional arguments)")):
    TrainConfig(loss=f"{module_file}:load")


def test_unknown_names_mention_your_own_code():
  with pytest.raises(ValueError, match=(
      r"model='resnet9000' is unknown. Did you mean 'resnet50'\? Choose one of "
      r"convnet, .*, or name "
      r"your own builder as 'package.module:function' or "
      r"'path/to/file.py:function'")):
    TrainConfig(model="resnet9000")


def test_good_references_are_checked_without_importing(module_file):
  config = TrainConfig(model=f"{module_file}:build",
                       dataset=f"{module_file}:load",
                       loss=f"{module_file}:squared_error",
                       metrics=f"mae,{module_file}:abs_error")
  assert config.metrics == ("mae", f"{module_file}:abs_error")
  assert "regression_user" not in sys.modules  # Read, not run.


def test_cli_errors_answer_before_tensorflow_loads(tmp_path):
  """Each bad reference exits 1 naming the flag, TensorFlow never imported."""
  user = tmp_path / "mine.py"
  user.write_text("import keras\n\ndef build(input_shape):\n  pass\n")
  for flag, expected in (
      (f"--model={user}:build", r"flag --model=.*mine.py:build: model=.*: "
       r"build\(input_shape\) cannot be called as build\(input_shape, "
       r"num_classes\)"),
      (f"--dataset={user}:load", r"flag --dataset=.*: .*mine.py defines no "
       r"'load'. Its functions: build.")):
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tfmgpu.train", flag],
        capture_output=True, text=True, timeout=60, check=False, env=ENV)
    assert run.returncode == 1
    assert re.search(expected, run.stderr), run.stderr[-2000:]
    assert not re.search(r"\|\s*(tensorflow|keras)$", run.stderr, re.M)


# ------------------------------------------ on import: the registries' lookup

def test_import_time_errors_name_the_setting(module_file, tmp_path):
  with pytest.raises(user_code.UserCodeError, match=re.escape(
      f"model='{module_file}:not_a_function' names an object of type int, "
      "not a function. Name a function: build(input_shape, num_classes).")):
    models.model_builder(f"{module_file}:not_a_function")
  # A decorated def is checked on import, by the signature it then has.
  assert callable(models.model_builder(f"{module_file}:decorated"))
  broken = tmp_path / "broken.py"
  broken.write_text("import no_such_dependency\n\ndef load():\n  pass\n")
  with pytest.raises(user_code.UserCodeError, match=re.escape(
      f"dataset='{broken}:load': importing {str(broken)!r} failed: "
      "ModuleNotFoundError: No module named 'no_such_dependency'")):
    data.dataset_entry(f"{broken}:load")
  with pytest.raises(user_code.UserCodeError, match=r"importing .* failed"):
    TrainConfig(dataset=f"{broken}:load").check_user_code()


def test_a_file_is_imported_once_and_its_options_are_read(module_file):
  first = models.model_builder(f"{module_file}:build")
  assert models.model_builder(f"{module_file}:build") is first
  entry = data.dataset_entry(f"{module_file}:load")
  assert entry.options == ("seed",)  # It takes seed=, not path=.
  config = TrainConfig(dataset=f"{module_file}:load", seed=3)
  assert config.dataset_options() == {"seed": 3}


def test_a_loader_returns_keras_splits_or_arrays(module_file):
  arrays = data.load_dataset(f"{module_file}:load")
  assert arrays.input_shape == {"a": (3,), "b": (2,)}
  assert arrays.num_classes is None and arrays.name.endswith(":load")
  x = np.zeros((4, 2), np.float32)
  labelled = data.user_arrays("mine", ((x, np.array([0, 2, 1, 2])),
                                       (x[:2], np.array([3, 0]))))
  assert labelled.num_classes == 4 and labelled.input_shape == (2,)
  with pytest.raises(ValueError, match=re.escape(
      "dataset='mine' returned a dict; a loader returns ((x_train, y_train), "
      "(x_test, y_test)) as keras.datasets do")):
    data.user_arrays("mine", {"x_train": x})
  with pytest.raises(ValueError, match=re.escape(
      "dataset='mine': the train arrays have different row counts [3, 4]")):
    data.user_arrays("mine", (({"a": x, "b": x[:3]}, x[:, 0]), (x, x[:, 0])))


def test_per_token_labels_give_the_vocabulary_as_num_classes():
  """`(N, T)` integer labels (next tokens) once gave `num_classes=None`, and
  a language model's builder then failed on the `None`."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 20, size=(12, 9)).astype(np.int32)
  tokens[3, 4] = 19
  arrays = data.user_arrays("mine", ((tokens[:8, :-1], tokens[:8, 1:]),
                                     (tokens[8:, :-1], tokens[8:, 1:])))
  assert arrays.num_classes == 20 and arrays.input_shape == (8,)
  data.check_labels(arrays)
  model = models.build_model("gpt", input_shape=arrays.input_shape,
                             num_classes=arrays.num_classes, seed=0)
  assert tuple(model.output.shape) == (None, 8, 20)
  floats = data.user_arrays("mine", ((tokens, tokens * 0.5),
                                     (tokens, tokens * 0.5)))
  assert floats.num_classes is None  # Float targets: no classes.


# --------------------------------------------------------------- a real run

def test_a_regression_run_reports_the_users_loss_and_metrics(module_file,
                                                             tmp_path):
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top  (loads TF)
  config = TrainConfig(
      strategy="mirrored", num_replicas=2, model=f"{module_file}:build",
      dataset=f"{module_file}:load", loss=f"{module_file}:squared_error",
      metrics=("mae", f"{module_file}:abs_error"), optimizer="sgd",
      learning_rate=0.05, epochs=2, global_batch_size=32, verbose=0,
      model_dir=str(tmp_path / "run"))
  summary = runs.run_training(config)
  text = str(summary)
  assert re.search(rf"model\s+{re.escape(module_file)}:build", text), text
  assert re.search(r"test loss / mae / abs_error\s+[\d.]+ / [\d.]+ / [\d.]+",
                   text), text
  assert "accuracy" not in text and np.isnan(summary.test_accuracy)
  # The reported figures are Keras' own on the same weights and test rows.
  import keras  # pylint: disable=g-import-not-at-top
  (_, _), (x_test, y_test) = sys.modules["regression_user"].load(seed=0)
  saved = keras.models.load_model(summary.saved_model)  # One device.
  saved.compile(loss="mse", metrics=["mae"])
  loss, mae = saved.evaluate(x_test, y_test, verbose=0)
  assert summary.test_loss == pytest.approx(loss, rel=1e-5)
  assert summary.test_metrics["mae"] == pytest.approx(mae, rel=1e-5)
  assert summary.test_metrics["abs_error"] == pytest.approx(mae, rel=1e-5)
  assert summary.train_metrics["mae"] < 2.0  # It learnt (targets' sd ~2.3).


def test_a_compiled_model_from_a_build_function_is_said_to_be_unused(
    digits_arrays, tmp_path, caplog):
  """A run trains with its settings: a compile() in the user's build was
  ignored without a word (a dict of per-output losses then failed deep in
  TF on the default loss). Arrays given as a loader returns them (a tuple:
  it raised AttributeError)."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top

  def build(input_shape, num_classes):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(num_classes)])
    model.compile(optimizer="sgd", loss="mse")
    return model

  d = digits_arrays  # As a --dataset loader returns them: a tuple.
  summary = runs.run_training(
      TrainConfig(epochs=1, steps_per_epoch=2, verbose=0,
                  model_dir=str(tmp_path / "run")),
      model_fn=build, arrays=((d.x_train, d.y_train), (d.x_test, d.y_test)))
  assert summary.model.output_shape == (None, d.num_classes)
  warned = [r.getMessage() for r in caplog.records
            if "not with that compile()" in r.getMessage()]
  assert len(warned) == 1, caplog.text
  assert re.search(r"optimizer=adam, learning_rate=[\d.]+, loss=sparse "
                   r"cross-entropy from logits \(the default\), "
                   r"metrics=accuracy \(the default\).*tfmgpu.Trainer\(model\) "
                   r"takes", warned[0]), warned[0]


TF_DATA_MODULE = '''
import numpy as np
import tensorflow as tf


def _arrays(n, seed):
  x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
  return x, ((x[:, 0] > 0) + 2 * (x[:, 1] > 0)).astype(np.int32)


def dataset():
  return tf.data.Dataset.from_tensor_slices(_arrays(128, 0)).batch(32)


def dataset_fn():
  def fn(context):
    return tf.data.Dataset.from_tensor_slices(_arrays(128, 0)).batch(
        context.get_per_replica_batch_size(32))
  return fn


def with_test():
  test = tf.data.Dataset.from_tensor_slices(_arrays(64, 1)).batch(32)
  return dataset(), test


def shapeless():
  return dataset().map(lambda x, y: (tf.py_function(tf.identity, [x],
                                                    tf.float32), y))
'''


def test_a_loader_may_return_a_tf_data_dataset_or_a_dataset_function(
    tmp_path):
  """Issue 29 item 9: `--dataset=file.py:fn` takes what `Trainer.fit` does:
  a `tf.data.Dataset` of global batches, a dataset function, or a
  `(train, test)` pair of them; each trains the same weights."""
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top  (loads TF)
  path = tmp_path / "tf_data_user.py"
  path.write_text(TF_DATA_MODULE)
  summaries = {}
  for fn in ("dataset", "dataset_fn", "with_test"):
    summaries[fn] = runs.run_training(TrainConfig(
        strategy="mirrored", num_replicas=2, model="mlp",
        dataset=f"{path}:{fn}", epochs=2, verbose=0,
        model_dir=str(tmp_path / fn)))
  assert {s.weights_digest for s in summaries.values()} == {
      summaries["dataset"].weights_digest}
  assert summaries["dataset"].result.steps == 8  # 4 batches, 2 epochs.
  assert 0 <= summaries["with_test"].test_accuracy <= 1
  assert "test loss              none (the loader gave no test split)" in (
      str(summaries["dataset"]))
  arrays = data.load_dataset(f"{path}:with_test")  # What predict reads.
  assert (arrays.input_shape, arrays.num_classes) == ((8,), 4)
  assert (len(arrays.x_train), len(arrays.x_test)) == (128, 64)
  # Said "Cannot iterate over a shape with unknown rank."
  with pytest.raises(ValueError, match=r"unknown rank .*tf\.ensure_shape"):
    data.load_dataset(f"{path}:shapeless")


def test_a_read_error_of_a_users_dataset_is_raised_as_it_is():
  """A shard named by a streamed dataset's `explain_read_error`; a user's
  `tf.data` has no such method (an AttributeError hid the error)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu import runs  # pylint: disable=g-import-not-at-top

  class Fails:  # A stand-in Trainer whose data fails to read.
    def fit(self, *args, **kwargs):
      raise tf.errors.NotFoundError(None, None, "/data/part-3: gone")
  user = data.UserDatasets("mine:fn", tf.data.Dataset.from_tensors(
      (tf.zeros([2, 3]), tf.constant([0, 1]))))
  with pytest.raises(tf.errors.NotFoundError, match="part-3: gone"):
    runs._fit_and_test(Fails(), TrainConfig(), user)  # pylint: disable=protected-access


@pytest.mark.slow
def test_the_readme_command_trains_the_example_module(tmp_path, parsed_flags,
                                                      capsys, monkeypatch):
  """Acceptance: the README's command (2 replicas), in-process from the
  checkout's root; then `python -m tfmgpu.predict` (in-process) serves the
  model it saved on the same dict-fed test rows, to the same accuracy.
  tests/test_readme_blocks.py runs the command as written in a subprocess."""
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import predict, train  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(ROOT)
  with flagsaver.flagsaver(model=f"{EXAMPLE}:build", dataset=f"{EXAMPLE}:load",
                           strategy="mirrored", num_replicas=2,
                           model_dir=str(tmp_path), verbose=0):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert re.search(rf"model\s+{EXAMPLE}:build\ndataset\s+{EXAMPLE}:load",
                   out), out
  assert "2 on /device:CPU:0, /device:CPU:1" in out
  accuracy = float(re.search(r"test loss / accuracy\s+[\d.]+ / ([\d.]+)",
                             out).group(1))
  assert accuracy >= 0.93, out
  with flagsaver.flagsaver(model_path=[str(tmp_path / "model.keras")],
                           dataset=f"{EXAMPLE}:load", strategy="mirrored",
                           num_replicas=2):
    assert predict.main(["predict"]) == 0
  served = capsys.readouterr().out
  assert re.search(rf"predicted\s+1000 rows.*\naccuracy\s+{accuracy:.4f}",
                   served, re.S), served


def test_an_error_raised_in_the_users_code_says_where(tmp_path):
  """Found by a new user: a loader's `ValueError("bad row")` printed only
  `error: bad row` (the CLI prints messages, not tracebacks), naming no
  file; the message now ends with the user's file, line and function,
  also through an error tfmgpu raised from it. Not for tfmgpu's own."""
  path = tmp_path / "my_loader.py"
  path.write_text("def load():\n  rows = []\n  raise ValueError('bad row')\n")
  load = user_code.load_function("dataset", f"{path}:load")
  with pytest.raises(ValueError) as raised:
    load()
  where = f"{path}:3 in load"
  assert user_code.describe_error(raised.value) == f"bad row (raised at {where})"
  try:
    try:
      load()
    except ValueError as e:
      raise RuntimeError("loading failed") from e
  except RuntimeError as e:
    assert user_code.raised_at(e) == where
  assert user_code.describe_error(ValueError("ours")) == "ours"


def test_an_error_in_a_traced_loss_is_said_by_its_own_message(tmp_path):
  """Found this session: a shape error in the user's `--loss` file printed
  AutoGraph's "in user code:" page of tfmgpu's and TF's frames; the CLI
  now prints the error it re-raised and the user's line."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = tmp_path / "my_loss.py"
  path.write_text("import tensorflow as tf\n"
                  "def bad(y, p):\n"
                  "  return tf.reshape(p, [-1, 3])\n")
  bad = user_code.load_function("loss", f"{path}:bad")
  step = tf.function(lambda p: bad(None, p))
  with pytest.raises(ValueError) as raised:
    step(tf.zeros([4, 10]))
  assert str(raised.value).startswith("in user code:")
  said = user_code.describe_error(raised.value)
  assert said.startswith("Dimension size must be evenly divisible by 3"), said
  assert said.endswith(f"(raised at {path}:3 in bad)"), said
  assert "in user code" not in said


def test_predict_cli_with_a_users_loader(tmp_path, parsed_flags, capsys):
  """`python -m tfmgpu.predict --dataset=file:load` names where the user's
  loader raised, as train does (it printed only `error: bad row`); a
  regression's `--output` is not called logits (it was)."""
  import keras  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import predict  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)],
                           name="predict_regression")
  model.save(tmp_path / "model.keras")
  loader = tmp_path / "rows.py"
  loader.write_text(
      "import numpy as np\n"
      "def load():\n"
      "  x, y = np.ones((8, 4), np.float32), np.zeros((8,), np.float32)\n"
      "  return (x, y), (x, y)\n"
      "def bad():\n"
      "  raise ValueError('bad row')\n")
  out = tmp_path / "out.npy"
  with flagsaver.flagsaver(model_path=[str(tmp_path / "model.keras")],
                           dataset=f"{loader}:bad"):
    assert predict.main(["predict"]) == 1
  err = capsys.readouterr().err
  assert f"error: bad row (raised at {loader}:6 in bad)" in err, err
  with flagsaver.flagsaver(model_path=[str(tmp_path / "model.keras")],
                           dataset=f"{loader}:load", output=str(out)):
    assert predict.main(["predict"]) == 0
  said = capsys.readouterr().out
  assert f"output     {out} (the model's outputs)\n" in said, said
  assert np.load(out).shape == (8, 1)
