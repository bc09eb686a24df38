"""The recipe of docs/architecture.md, followed from a test file: one class,
registered, trains through `run_training` and serves through `predict`.

The toy placement pins the whole model to one chosen device. It is a real
placement (its own `place` and `serve`), so the test checks where its
variables live, that it trains to the weights of the `default` strategy,
and that it serves what Keras predicts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import inference
from tfmgpu import runs
from tfmgpu import strategies
from tfmgpu.config import TrainConfig

DEVICE = "/device:CPU:3"


# --- the recipe: an options dataclass and one Distribution subclass --------

@dataclasses.dataclass(frozen=True)
class PinnedOptions:
  """`devices`: one device to pin to (also a `TrainConfig` field)."""
  devices: tuple[str, ...] | None = None

  def __post_init__(self):
    if self.devices is not None and len(self.devices) != 1:
      raise ValueError(f"pinned takes one device; got devices={self.devices}.")


class Pinned(strategies.Distribution):
  """The whole model on one device, under the default strategy."""
  name = "pinned_toy"
  description = "Toy placement: the whole model on one chosen device."
  kind = strategies.Kind.PLACEMENT
  Options = PinnedOptions
  layout = "device"

  def _device(self, options: PinnedOptions) -> str:
    return options.devices[0] if options.devices else "/cpu:0"

  def place(self, options, build, *, strategy=None, seed=0):
    del strategy, seed
    with tf.device(self._device(options)):
      model = build()
    return strategies.Placement(tf.distribute.get_strategy(),
                                [self._device(options)], model,
                                distribution=self, options=options)

  def serve(self, models, options):
    (model,) = models
    return model, tf.distribute.get_strategy()


# ---------------------------------------------------------------- the test

@pytest.fixture
def pinned():
  strategies.register(Pinned)
  yield strategies.lookup(Pinned.name)
  strategies.unregister(Pinned.name)


def _config(strategy: str, tmp_path, **kw) -> TrainConfig:
  return TrainConfig(strategy=strategy, model="mlp", epochs=1,
                     steps_per_epoch=6, steps_per_execution=3,
                     global_batch_size=32, optimizer="sgd", learning_rate=0.05,
                     model_dir=str(tmp_path / strategy), verbose=0, **kw)


def test_a_placement_registered_in_a_test_trains_and_serves(
    pinned, digits_arrays, tmp_path):
  assert Pinned.name in strategies.available_strategies()
  summary = runs.run_training(
      _config(Pinned.name, tmp_path, devices=(DEVICE,)), arrays=digits_arrays)
  assert summary.layout == [("device", f"1 on {DEVICE}")]
  assert {v.value.device for v in summary.model.weights} == {
      "/job:localhost/replica:0/task:0" + DEVICE}
  reference = runs.run_training(_config("default", tmp_path),
                                arrays=digits_arrays)
  for got, want in zip(summary.model.get_weights(),
                       reference.model.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  model, strategy = inference.place_for_serving(
      [summary.model], Pinned.name, devices=(DEVICE,))
  x = digits_arrays.x_test[:100]
  np.testing.assert_allclose(
      inference.predict(model, x, strategy=strategy),
      summary.model.predict(x, verbose=0), rtol=1e-5, atol=1e-5)


def test_its_options_are_checked_and_named(pinned):
  with pytest.raises(ValueError, match=r"pinned takes one device"):
    TrainConfig(strategy=Pinned.name, devices=("/cpu:0", "/cpu:1"))
  with pytest.raises(ValueError, match=r"strategy 'pinned_toy' got an unknown "
                     r"option \(num_stages\). Its options: devices"):
    pinned.options(num_stages=2)
