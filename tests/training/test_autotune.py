"""Autotune: measured choices, cached and reused; off gives the defaults.

The timing function is injected (a table of ms per step by settings), so
every choice here is exact and no wall-clock duration is asserted.
"""

import dataclasses
import itertools
import json
import logging
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import models
from tfmgpu.config import TrainConfig
from tfmgpu.training import autotune

KEY = {"model": "mlp-0123", "replicas": 2}
CURRENT = autotune.Settings()


class FakeTimer:
  """`measure(settings)`: ms per step from a table of speed-ups; counts calls.

  `speedups` maps `"option=value"` to how much faster that change alone
  makes a step (1.0 when absent); changes multiply.
  """

  def __init__(self, speedups=None, base_ms=2.0, impossible=()):
    self.speedups = speedups or {}
    self.base_ms = base_ms
    self.impossible = impossible
    self.calls = []

  def __call__(self, settings):
    self.calls.append(settings)
    factor = 1.0
    for name, value in CURRENT.changes(settings).items():
      if f"{name}={value}" in self.impossible:
        raise ValueError(f"{name}={value!r} needs something else")
      factor *= self.speedups.get(f"{name}={value}", 1.0)
    return self.base_ms / factor


def test_the_choice_is_cached_and_reused(tmp_path):
  cache = str(tmp_path / "autotune.json")
  timer = FakeTimer({"jit_compile=True": 1.25})
  first = autotune.tune(timer, key=KEY, cache=cache)
  assert first.source == "measured"
  assert first.settings == dataclasses.replace(CURRENT, jit_compile=True)
  measured = len(timer.calls)
  # current, tf_data, spe 20 and 40, jit, float16: 6 candidates x 2 rounds,
  # then current and jit again in 3 paired rounds, then jit and jit with
  # each of the other 4 changes on top in 3 more.
  assert measured == 12 + 6 + 15
  second = autotune.tune(timer, key=KEY, cache=cache)
  assert len(timer.calls) == measured  # Nothing measured again.
  assert second.source == "cache"
  assert second.settings == first.settings
  assert second.times_ms == first.times_ms
  assert second.reason == first.reason
  entry, = json.load(open(cache)).values()
  assert entry["settings"]["jit_compile"] is True
  assert entry["key"]["cpu"] == autotune.cpu_model()
  assert entry["key"]["tensorflow"] == tf.__version__


def test_off_gives_todays_defaults_and_measures_nothing(tmp_path):
  timer = FakeTimer({"jit_compile=True": 2.0})
  choice = autotune.tune(timer, key=KEY, enabled=False,
                         cache=str(tmp_path / "a.json"))
  assert choice.settings == autotune.Settings() and choice.source == "off"
  assert not timer.calls and not (tmp_path / "a.json").exists()
  # The autotune's defaults are the run's defaults.
  defaults = TrainConfig()
  for name in autotune.TUNED:
    assert getattr(choice.settings, name) == getattr(defaults, name), name
  assert defaults.autotune is False


def test_a_change_must_beat_the_margin(tmp_path):
  slightly = autotune.tune(
      FakeTimer({"jit_compile=True": 1.03, "input_mode=tf_data": 0.7}),
      key=KEY, cache=str(tmp_path / "a.json"))
  assert slightly.settings == CURRENT and not slightly.picked
  assert "jit_compile=True 1.03x" in slightly.reason
  assert "None was faster by 5% or more" in slightly.reason
  assert slightly.describe().startswith(
      "autotune (measured): kept the current settings.")


def test_winners_are_measured_together(tmp_path):
  timer = FakeTimer({"steps_per_execution=20": 1.1,
                     "steps_per_execution=40": 1.15,
                     "gradient_compression=float16": 1.2})
  choice = autotune.tune(timer, key=KEY, cache=str(tmp_path / "a.json"))
  assert choice.picked == {"steps_per_execution": 40,
                           "gradient_compression": "float16"}
  together = "steps_per_execution=40 + gradient_compression=float16"
  assert choice.settings in timer.calls  # Measured together.
  assert choice.times_ms[together] == pytest.approx(2.0 / 1.15 / 1.2)
  assert (f"Picked {together}: faster by 5% or more in the first rounds and "
          "in the median paired round, slower in none") in choice.reason
  assert ("Measured again in paired rounds beside the current settings (the "
          "median round): gradient_compression=float16 1.20x (worst 1.20x), "
          "steps_per_execution=40 + gradient_compression=float16 1.38x "
          "(worst 1.38x)") in choice.reason
  assert "autotune (measured): picked " + together in choice.describe()


def test_an_option_that_pays_only_on_top_of_a_pick_is_added(tmp_path):
  """Batch splits alone gain nothing here but 1.15x under XLA: the second
  pass finds them; an option no faster on top is not added."""
  timer = FakeTimer({"jit_compile=True": 1.2})

  def measure(settings):
    ms = timer(settings)
    return ms / 1.15 if settings.jit_compile and settings.batch_splits == 2 \
        else ms

  space = autotune.search_space(CURRENT, replicas=1, splittable=True)
  choice = autotune.tune(measure, key=KEY, space=space,
                         cache=str(tmp_path / "a.json"))
  assert choice.picked == {"jit_compile": True, "batch_splits": 2}
  assert "batch_splits=2 1.00x" in choice.reason  # Alone.
  assert ("Then each other option on top of it, in paired rounds beside it "
          "(the median round): ") in choice.reason
  assert "jit_compile=True + batch_splits=2 1.15x" in choice.reason
  assert "input_mode=tf_data + jit_compile=True 1.00x" in choice.reason
  assert choice.reason.endswith("picked jit_compile=True + batch_splits=2.")


def test_a_win_that_does_not_hold_is_not_picked(tmp_path):
  """Noise: XLA looks 1.5x faster in the first rounds, not when measured
  again beside the current settings."""
  timer = FakeTimer({"jit_compile=True": 1.5})
  calls = []

  def measure(settings):
    calls.append(settings)
    if settings.jit_compile and len(calls) > 12:
      return timer.base_ms  # The second look: no faster.
    return timer(settings)

  choice = autotune.tune(measure, key=KEY, cache=str(tmp_path / "a.json"))
  assert choice.settings == CURRENT and not choice.picked
  assert choice.times_ms["jit_compile=True"] == pytest.approx(2.0 / 1.5)
  assert ("Measured again in paired rounds beside the current settings (the "
          "median round): jit_compile=True 1.00x (worst 1.00x): none faster "
          "by 5% or more in the median round and slower in none; kept "
          "them.") in choice.reason


def test_a_pick_must_lose_no_paired_round(tmp_path):
  """Noise of the kind that once picked float16 compression for convnet x2
  (0.8x when measured side by side): it wins the first rounds and two of
  three paired rounds, and loses the third; it is not picked."""
  timer = FakeTimer({"gradient_compression=float16": 1.3})
  calls = []

  def measure(settings):
    calls.append(settings)
    if len(calls) == 12 + 2 * 2 + 2:  # float16 in the third paired round.
      assert settings.gradient_compression == "float16"
      return timer.base_ms * 1.1
    return timer(settings)

  choice = autotune.tune(measure, key=KEY, cache=str(tmp_path / "a.json"))
  assert len(calls) == 12 + 6
  assert choice.settings == CURRENT and not choice.picked
  assert ("gradient_compression=float16 1.30x (worst 0.91x): none faster"
          in choice.reason)


def test_one_paired_round_below_the_margin_does_not_hide_a_gain(tmp_path):
  """The machine's drift: batch splits under XLA gain 1.15x, but one paired
  round shows 1.03x; the median holds the margin and no round is slower,
  so they are added."""
  timer = FakeTimer({"jit_compile=True": 1.2})
  calls = []

  def measure(settings):
    calls.append(settings)
    ms = timer(settings)
    if settings.jit_compile and settings.batch_splits == 2:
      unlucky = sum(s == settings for s in calls) == 2
      return ms / (1.03 if unlucky else 1.15)
    return ms

  space = autotune.search_space(CURRENT, replicas=1, splittable=True)
  choice = autotune.tune(measure, key=KEY, space=space,
                         cache=str(tmp_path / "a.json"))
  assert choice.picked == {"jit_compile": True, "batch_splits": 2}
  assert "jit_compile=True + batch_splits=2 1.15x (worst 1.03x)" in (
      choice.reason)


def test_the_cpu_name_only_keys_the_cache(tmp_path, monkeypatch):
  cache = str(tmp_path / "a.json")
  choices = []
  for name in ("Intel(R) Xeon(R)", "AMD EPYC"):
    monkeypatch.setattr(autotune, "cpu_model", lambda name=name: name)
    timer = FakeTimer({"gradient_compression=float16": 1.3})
    choices.append(autotune.tune(timer, key=KEY, cache=cache))
    assert timer.calls  # Another machine: measured, not read.
  assert choices[0].settings == choices[1].settings
  assert len(json.load(open(cache))) == 2
  timer = FakeTimer()
  assert autotune.tune(timer, key={**KEY, "replicas": 4},
                       cache=cache).source == "measured"


def test_an_impossible_option_is_skipped_and_named(tmp_path):
  timer = FakeTimer({"jit_compile=True": 1.5},
                    impossible=("input_mode=tf_data",))
  choice = autotune.tune(timer, key=KEY, cache=str(tmp_path / "a.json"))
  assert choice.picked == {"jit_compile": True}
  assert ("input_mode=tf_data impossible here (input_mode='tf_data' needs "
          "something else)") in choice.reason


def test_bad_arguments_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"needs \['replicas'\] and rounds=0"):
    autotune.tune(FakeTimer(), key={"model": "m"}, rounds=0,
                  cache=str(tmp_path / "a.json"))
  with pytest.raises(ValueError, match="could not measure the current "
                     "settings .*: input_mode='tf_data' needs"):
    autotune.tune(FakeTimer(impossible=("input_mode=tf_data",)),
                  key=KEY, current=dataclasses.replace(
                      CURRENT, input_mode="tf_data"),
                  space={"input_mode": ("tf_data", "device")},
                  cache=str(tmp_path / "a.json"))


def test_an_unreadable_cache_is_rewritten(tmp_path, caplog):
  cache = tmp_path / "a.json"
  cache.write_text("{not json")
  with caplog.at_level(logging.WARNING):
    choice = autotune.tune(FakeTimer(), key=KEY, cache=str(cache))
  assert choice.source == "measured"
  assert "Ignoring the unreadable autotune cache" in caplog.text
  assert len(json.load(open(cache))) == 1


def test_the_search_space():
  space = autotune.search_space(CURRENT, replicas=1,
                                max_steps_per_execution=30)
  assert space == {"input_mode": ("auto", "tf_data"),
                   "steps_per_execution": (10, 20),
                   "jit_compile": (False, True)}
  space = autotune.search_space(
      dataclasses.replace(CURRENT, input_mode="tf_data"), replicas=2)
  assert space["input_mode"] == ("tf_data", "device")
  assert space["gradient_compression"] == ("none", "float16")
  assert "batch_splits" not in space
  space = autotune.search_space(CURRENT, replicas=1, splittable=True)
  assert space["batch_splits"] == (1, 2)


def test_model_signature_follows_the_shape():
  def sig(hidden):
    return autotune.model_signature(
        models.build_model("mlp", input_shape=(8,), num_classes=3,
                           width=hidden, seed=0))
  assert sig(16) == sig(16)
  assert sig(16) != sig(32)


def test_trainer_timer_times_calls_with_the_given_clock():
  """A real short `Trainer.fit`, timed by a clock that ticks 4 ms per read:
  each call of 5 steps then takes 4 ms, 0.8 ms per step; the second
  measurement reuses the first's trainer."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 8)).astype(np.float32)
  y = rng.integers(0, 3, size=256).astype(np.int32)
  ticks = itertools.count(0.0, 0.004)
  built = []

  def build():
    built.append(1)
    return models.build_model("mlp", input_shape=(8,), num_classes=3,
                              width=8, seed=0)

  timer = autotune.TrainerTimer(
      build, tf.distribute.get_strategy(), x, y, global_batch_size=32,
      calls=3, clock=lambda: next(ticks))
  settings = dataclasses.replace(CURRENT, steps_per_execution=5)
  assert timer(settings) == pytest.approx(0.8)
  assert timer(settings) == pytest.approx(0.8)
  assert len(built) == 1
  timer.close()


class _FakeTrainerTimer(FakeTimer):
  """Stands in for `TrainerTimer` (same constructor): XLA 2x faster."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    super().__init__({"jit_compile=True": 2.0})

  def close(self):
    pass


@pytest.mark.usefixtures("parsed_flags")
def test_train_autotune_flag_is_off_by_default_and_tunes_the_run(
    tmp_path, monkeypatch, digits_arrays):
  import types  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import runs, strategies, train  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver():
    assert train.config_from_flags().autotune is False
  with flagsaver.flagsaver(autotune=True, model="mlp", strategy="mirrored",
                           num_replicas=2):
    config = train.config_from_flags()
  assert config.autotune is True
  monkeypatch.setenv("TFMGPU_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(autotune, "TrainerTimer", _FakeTrainerTimer)
  placement = types.SimpleNamespace(
      strategy=strategies.get_strategy("mirrored", num_replicas=2),
      model=None)
  tuned = runs._autotuned(  # pylint: disable=protected-access
      config, placement, digits_arrays,
      runs._model_builder(config, digits_arrays, None))  # pylint: disable=protected-access
  assert tuned == config.replace(jit_compile=True)
  assert (tmp_path / autotune.CACHE_FILE).exists()


def test_multi_host_strategies_are_not_tuned(tmp_path):

  class ParameterServerStrategy:  # Not a one-host strategy.
    pass

  choice = autotune.tune_training(
      lambda: None, ParameterServerStrategy(), np.zeros((64, 2)), np.zeros(64),
      global_batch_size=8, cache=str(tmp_path / "a.json"))
  assert choice.source == "off" and choice.settings == CURRENT
  assert ("Not tuned: ParameterServerStrategy is not a one-host strategy"
          in choice.reason)
  assert not (tmp_path / "a.json").exists()


def _package(root, files):
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return str(root)


def test_the_code_that_runs_keys_the_cache(tmp_path):
  """Two checkouts (or one before and after an edit) never share a choice;
  the same code in two places does, and so does an edit of the bench's
  harness alone (`tfmgpu/benchmarks/`, `tfmgpu/bench.py`)."""
  files = {"__init__.py": "", "training/autotune.py": "A = 1\n"}
  one = _package(tmp_path / "one" / "tfmgpu", files)
  same = _package(tmp_path / "same" / "tfmgpu", files)
  edited = _package(tmp_path / "edited" / "tfmgpu",
                    {**files, "training/autotune.py": "A = 2\n"})
  moved = _package(tmp_path / "moved" / "tfmgpu",
                   {"__init__.py": "", "autotune.py": "A = 1\n"})
  _package(tmp_path / "same" / "tfmgpu", {"__pycache__/x.py": "junk",
                                         "benchmarks/suite.py": "B = 2\n",
                                         "bench.py": "C = 3\n"})
  _package(tmp_path / "edited" / "tfmgpu", {"training/benchmarks/x.py": ""})
  versions = [autotune.code_version(p) for p in (one, same, edited, moved)]
  assert versions[0] == versions[1]  # The bench's harness is not keyed.
  assert len(set(versions[1:])) == 3
  assert autotune.machine_key()["tfmgpu_code"] == autotune.code_version()
  assert autotune.code_version() == autotune.code_version(
      str(pathlib.Path(autotune.__file__).parents[1]))


def test_another_checkout_measures_again_and_cached_only_measures_nothing(
    tmp_path, monkeypatch):
  cache = str(tmp_path / "autotune.json")
  timer = FakeTimer({"jit_compile=True": 1.25})
  autotune.tune(timer, key=KEY, cache=cache)
  measured = len(timer.calls)
  assert autotune.tune(timer, key=KEY, cache=cache).source == "cache"
  monkeypatch.setattr(autotune, "code_version", lambda: "other-checkout")
  quick = autotune.tune(timer, key=KEY, cache=cache, cached_only=True)
  assert len(timer.calls) == measured
  assert quick.source == "not cached" and quick.settings == CURRENT
  assert autotune.tune(timer, key=KEY, cache=cache).source == "measured"
  assert len(json.load(open(cache))) == 2
