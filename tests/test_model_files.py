"""`model.keras` is replaced whole or not at all; a damaged one is named."""

import json
import os
import re
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest

from tfmgpu import inference
from tfmgpu import runs


def _model(value):
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.set_weights([np.full((3, 2), value, np.float32),
                     np.zeros((2,), np.float32)])
  return model


def test_save_model_replaces_the_file_whole(tmp_path):
  path = str(tmp_path / "model.keras")
  assert runs.save_model(_model(1.0), path) == path
  assert runs.save_model(_model(2.0), path) == path
  assert os.listdir(tmp_path) == ["model.keras"]  # No temporary file left.
  np.testing.assert_array_equal(
      inference.load_model(path).get_weights()[0], np.full((3, 2), 2.0))


def test_a_save_that_fails_midway_keeps_the_previous_file(tmp_path,
                                                          monkeypatch):
  path = str(tmp_path / "model.keras")
  runs.save_model(_model(1.0), path)
  before = open(path, "rb").read()

  def disk_full(self, filepath, *args, **kwargs):
    with open(filepath, "wb") as f:
      f.write(before[:100])  # What a full disk leaves.
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(keras.Model, "save", disk_full)
  with pytest.raises(OSError, match="No space left on device"):
    runs.save_model(_model(2.0), path)
  assert open(path, "rb").read() == before
  assert os.listdir(tmp_path) == ["model.keras"]


def test_save_model_fsyncs_the_file_before_renaming_it(tmp_path, monkeypatch):
  events = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(runs.os, "fsync", lambda fd: (events.append(
      ("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
  monkeypatch.setattr(runs.os, "replace", lambda a, b: (events.append(
      ("replace", a, b)), real_replace(a, b))[1])
  path = str(tmp_path / "model.keras")
  runs.save_model(_model(1.0), path)
  (_, aside), (_, src, dst), (_, directory) = events
  assert (src, dst) == (aside, path)
  assert os.path.dirname(aside) == directory == str(tmp_path)


def _damaged(tmp_path, how):
  path = str(tmp_path / "model.keras")
  runs.save_model(_model(1.0), path)
  data = open(path, "rb").read()
  if how == "empty":
    open(path, "wb").close()
  elif how == "truncated":
    open(path, "wb").write(data[:len(data) // 2])
  else:  # A corrupt weights file inside the zip, or none.
    with zipfile.ZipFile(str(tmp_path / "good.keras"), "w") as out, \
        zipfile.ZipFile(path) as good:
      for name in good.namelist():
        if name.endswith(".h5") and how == "no weights":
          continue
        out.writestr(name, b"garbage" if name.endswith(".h5")
                     else good.read(name))
    os.replace(tmp_path / "good.keras", path)
  return path


@pytest.mark.parametrize("how", ["empty", "truncated", "corrupt weights"])
def test_a_damaged_keras_file_is_named(tmp_path, how):
  path = _damaged(tmp_path, how)
  with pytest.raises(ValueError, match=rf"model_path={re.escape(repr(path))} "
                     r"is not a valid \.keras file \(\d+ bytes"):
    inference.load_model(path)
  # The same through the run directory.
  with pytest.raises(ValueError, match=r"is not a valid \.keras file"):
    inference.load_model(str(tmp_path))


def test_a_keras_file_without_weights_is_named(tmp_path):
  """Keras said only "Expected a model.weights.h5 or model.weights.npz
  file", naming no file."""
  path = _damaged(tmp_path, "no weights")
  with pytest.raises(ValueError, match=rf"^model_path={re.escape(repr(path))} "
                     r"\(\d+ bytes\) did not load: Expected a model\.weights"):
    inference.load_model(path)


_CUSTOM_LAYER = '''
import keras
@keras.saving.register_keras_serializable(package="{package}")
class Triple(keras.layers.Layer):
  def call(self, x):
    return x * 3
def build(input_shape, num_classes):
  return keras.Sequential([keras.Input(input_shape), Triple(),
                           keras.layers.Dense(num_classes)], name="mine")
'''


def test_a_runs_custom_layers_load_from_the_model_file_it_records(tmp_path):
  """A run trained with --model=my_model.py:build and a custom layer: its
  model.keras failed in `predict` with Keras' "Could not locate class"
  (and the whole config) until the user's module was imported."""
  package = f"p{os.getpid()}"  # Registered by no other test.
  source = tmp_path / "my_model.py"
  source.write_text(_CUSTOM_LAYER.format(package=package))
  run = tmp_path / "run"
  run.mkdir()
  subprocess.run([sys.executable, "-c", (
      "import sys; sys.path.insert(0, sys.argv[1]); import my_model; "
      "my_model.build((3,), 2).save(sys.argv[2])"),
      str(tmp_path), str(run / "model.keras")], check=True)
  with pytest.raises(ValueError, match=r"uses 'Triple', which no "
                     r"module imported here registers. A class of your own"):
    inference.load_model(str(run / "model.keras"))  # No run.json: unknown.
  (run / "run.json").write_text(json.dumps(
      {"model": f"{tmp_path}/moved.py:build"}))
  with pytest.raises(ValueError, match=r"Here .*run\.json records "
                     r"--model=.*moved\.py:build, and .*moved\.py is not there "
                     r"now: give the file back its path"):
    inference.load_model(str(run))
  (run / "run.json").write_text(json.dumps({"model": f"{source}:build"}))
  model = inference.load_model(str(run))
  np.testing.assert_allclose(model.layers[0](np.ones((1, 3))), 3.0)


def test_a_layer_that_cannot_rebuild_from_its_config_is_said_short(tmp_path):
  """A custom layer whose `__init__` takes no `**kwargs`: Keras' error held
  the model's config once per nested layer (kilobytes) before its cause."""
  @keras.saving.register_keras_serializable(package=f"q{os.getpid()}")
  class Scale(keras.layers.Layer):
    def __init__(self, factor):  # No **kwargs: from_config fails.
      super().__init__()
      self.factor = factor

    def call(self, x):
      return x * self.factor
  model = keras.Sequential([keras.Input((3,)), Scale(2.0),
                            keras.layers.Dense(2)], name="scaled")
  path = str(tmp_path / "scaled.keras")
  model.save(path)
  with pytest.raises(TypeError) as raised:
    inference.load_model(path)
  said = str(raised.value)
  assert "config={'module'" not in said and len(said) < 1200, said
  assert re.search(r"did not load: .* Keras said: \S*Scale\.__init__\(\) got an "
                   r"unexpected keyword argument 'trainable'\. A layer of "
                   r"your own rebuilds from its get_config\(\)", said), said
