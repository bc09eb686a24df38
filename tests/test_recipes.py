"""The recipes of docs/architecture.md for a strategy, a model and a dataset,
followed from a test file (the placement recipe has its own test in
tests/placements/test_add_a_placement.py).

A toy dataset, a toy model and a toy data-parallel strategy are registered
here, trained together through `run_training`, and checked against the
built-in `mirrored` strategy on the same data and model: same weights.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import data as data_lib
from tfmgpu import models as models_lib
from tfmgpu import runs
from tfmgpu import strategies
from tfmgpu.config import TrainConfig


# --- a dataset: a loader returning `Arrays`, registered by name ------------

def load_stripes(seed: int = 0) -> data_lib.Arrays:
  """Vectors whose label is the index of their largest feature."""
  rng = np.random.default_rng(seed)
  x = rng.random((640, 6), dtype=np.float32)
  y = np.argmax(x[:, :3], axis=1).astype(np.int32)
  return data_lib.Arrays("stripes", x[:512], y[:512], x[512:], y[512:], 3)


# --- a model: a builder of (input_shape, num_classes), registered by name --

def tiny_net(input_shape, num_classes):
  return keras.Sequential([keras.Input(input_shape),
                           keras.layers.Dense(16, activation="relu"),
                           models_lib.logits_layer(num_classes)])


# --- a strategy: options dataclass + one Distribution subclass -------------

@dataclasses.dataclass(frozen=True)
class PairOptions:
  """No options of its own: always the first two accelerator devices."""


class FirstPair(strategies.Distribution):
  """`MirroredStrategy` over the first two devices, one-device all-reduce."""
  name = "first_pair_toy"
  description = "Toy strategy: mirrored over the first two devices."
  Options = PairOptions

  def make_strategy(self, options):
    del options
    import tfmgpu  # pylint: disable=g-import-not-at-top
    return tf.distribute.MirroredStrategy(
        tfmgpu.list_devices()[:2],
        cross_device_ops=tf.distribute.ReductionToOneDevice())

  def place(self, options, build, *, strategy=None, seed=0):
    strategy = strategy or self.make_strategy(options)
    with strategy.scope():
      model = build()
    return strategies.Placement(strategy, ["pair:0", "pair:1"], model,
                                distribution=self, options=options)


@pytest.fixture
def registered():
  data_lib.register_dataset("stripes_toy", "Toy: argmax of 3 features.",
                            options=("seed",))(load_stripes)
  models_lib.register_model("tiny_toy", "Toy: one hidden layer.")(tiny_net)
  strategies.register(FirstPair)
  yield
  strategies.unregister(FirstPair.name)
  models_lib.unregister_model("tiny_toy")
  data_lib.unregister_dataset("stripes_toy")


def test_a_strategy_model_and_dataset_registered_in_a_test_train(
    registered, tmp_path):
  common = dict(model="tiny_toy", dataset="stripes_toy", epochs=2,
                global_batch_size=32, optimizer="sgd", learning_rate=0.1,
                steps_per_execution=4, verbose=0)
  toy = runs.run_training(TrainConfig(
      strategy=FirstPair.name, model_dir=str(tmp_path / "toy"), **common))
  assert toy.replicas == 2
  assert toy.layout == [("replicas", "2 on pair:0, pair:1")]
  assert toy.result.history["loss"][-1] < toy.result.history["loss"][0]
  reference = runs.run_training(TrainConfig(
      strategy="mirrored", num_replicas=2, model_dir=str(tmp_path / "ref"),
      **common))
  for got, want in zip(toy.model.get_weights(),
                       reference.model.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_registered_names_are_listed_while_registered(registered):
  del registered
  assert "stripes_toy" in data_lib.available_datasets()
  assert "tiny_toy" in models_lib.available_models()
  assert FirstPair.name in strategies.available_strategies()
