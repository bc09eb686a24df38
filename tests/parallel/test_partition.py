"""plan_stages: exact balancing, split points, devices, validation and errors."""

import itertools
import random
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfmgpu
from tfmgpu.models import demo
from tfmgpu.parallel import partition

plan_stages = partition.plan_stages


def _brute_force(costs, k):
  """Smallest possible largest-part cost over every contiguous k-split."""
  n = len(costs)
  best = float("inf")
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0,) + cuts + (n,)
    best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
  return best


def test_partitioner_is_optimal_against_brute_force():
  rng = random.Random(0)
  for trial in range(300):
    n = rng.randint(1, 9)
    costs = [rng.choice([0, rng.randint(1, 100), rng.random() * 50])
             for _ in range(n)]
    k = rng.randint(1, n)
    starts = partition.min_max_partition(costs, k)
    assert starts[0] == 0 and len(starts) == k
    assert starts == sorted(set(starts)) and starts[-1] < n
    bounds = starts + [n]
    got = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert got == pytest.approx(_brute_force(costs, k), rel=1e-12,
                                abs=1e-12), (trial, costs, k)


def _brute_force_with_cuts(costs, cuts, k):
  """As `_brute_force`, each part also paying the cuts at its two ends."""
  n = len(costs)
  edge = [0.0] + list(cuts) + [0.0]
  best = float("inf")
  for inner in itertools.combinations(range(1, n), k - 1):
    bounds = (0,) + inner + (n,)
    best = min(best, max(sum(costs[a:b]) + edge[a] + edge[b]
                         for a, b in zip(bounds, bounds[1:])))
  return best


def test_partitioner_with_cut_costs_is_optimal_against_brute_force():
  rng = random.Random(1)
  for trial in range(300):
    n = rng.randint(1, 9)
    costs = [rng.choice([0, rng.randint(1, 100), rng.random() * 50])
             for _ in range(n)]
    cuts = [rng.choice([0, rng.randint(1, 60), rng.random() * 30])
            for _ in range(n - 1)]
    k = rng.randint(1, n)
    starts = partition.min_max_partition(costs, k, cuts)
    assert starts[0] == 0 and len(starts) == k
    assert starts == sorted(set(starts)) and starts[-1] < n
    bounds = starts + [n]
    edge = [0.0] + cuts + [0.0]
    got = max(sum(costs[a:b]) + edge[a] + edge[b]
              for a, b in zip(bounds, bounds[1:]))
    assert got == pytest.approx(_brute_force_with_cuts(costs, cuts, k),
                                rel=1e-12, abs=1e-12), (trial, costs, cuts, k)


def test_an_expensive_cut_moves_the_split():
  # Free cuts: [4], [3], [3, 2] (max 5). A cut before item 1 that costs 10
  # is avoided: [4, 3], [3], [2] (max 7).
  costs, cuts = [4, 3, 3, 2], [10, 0, 0]
  assert partition.min_max_partition(costs, 3) == [0, 1, 2]
  starts = partition.min_max_partition(costs, 3, cuts)
  assert starts == [0, 2, 3]
  bounds = starts + [4]
  edge = [0.0] + cuts + [0.0]
  got = max(sum(costs[a:b]) + edge[a] + edge[b]
            for a, b in zip(bounds, bounds[1:]))
  assert got == _brute_force_with_cuts(costs, cuts, 3) == 7
  with pytest.raises(ValueError, match=r"cut_costs has 1 entries; 4 items "
                     r"need 3"):
    partition.min_max_partition(costs, 2, [1.0])


def test_partitioner_is_not_greedy():
  # Greedy filling up to total/k = 5 gives [4], [3, 3], [2] (max 6);
  # the optimum is [4], [3], [3, 2] (max 5).
  assert partition.min_max_partition([4, 3, 3, 2], 3) == [0, 1, 2]
  with pytest.raises(ValueError, match=r"num_parts=5 must be between 1 and"):
    partition.min_max_partition([1, 2], 5)


@pytest.mark.parametrize("criterion,key", [("params", "param_bytes"),
                                           ("flops", "flops"),
                                           ("balanced", "param_bytes")])
def test_deep_mlp_in_four_is_balanced(criterion, key):
  model = demo.deep_mlp((256,), 10, depth=8, width=256)
  plan = plan_stages(model, 4, criterion=criterion)
  values = [getattr(s, key) for s in plan.stages]
  assert max(values) <= 1.10 * sum(values) / 4, plan.table()
  assert plan.layer_names == tuple(l.name for l in model.layers)
  assert plan.criterion == criterion


def test_split_points_start_stages_and_sent_bytes_are_the_cut_tensor():
  model = demo.deep_mlp((32,), 10, depth=4, width=64)
  plan = plan_stages(model, 3, split_points=["hidden_1", "hidden_3"])
  assert [s.layers for s in plan.stages] == [
      ("hidden_0",), ("hidden_1", "hidden_2"), ("hidden_3", "logits")]
  assert plan.criterion == "split_points"
  assert [s.sent_bytes for s in plan.stages] == [64 * 4, 64 * 4, 0]
  assert [s.input_bytes for s in plan.stages] == [32 * 4, 64 * 4, 64 * 4]


def test_default_devices_are_the_accelerators_in_order(cpu_devices):
  model = demo.deep_mlp((8,), 2, depth=4, width=8)
  assert plan_stages(model, 3).devices == tuple(cpu_devices[:3])
  plan = plan_stages(model, 2, devices=["/cpu:3", "CPU:3"])
  assert plan.devices == ("/device:CPU:3", "/device:CPU:3")


def test_placements_are_registered():
  names = tfmgpu.available_strategies()
  assert "model_parallel" in names and "branch_parallel" in names
  assert tfmgpu.get_strategy("model_parallel") is (
      tfmgpu.get_strategy("default"))


def test_importing_the_package_registers_without_loading_tensorflow():
  # CLIs list --strategy choices before TensorFlow loads.
  code = ("import sys, tfmgpu.parallel, tfmgpu.strategies as s; "
          "assert 'tensorflow' not in sys.modules, 'TF imported'; "
          "print(sorted(s.available_strategies()))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=60)
  assert "'branch_parallel'" in out.stdout and "'model_parallel'" in out.stdout


# ------------------------------------------------------------------ errors


def test_more_stages_than_blocks():
  model = demo.deep_mlp((8,), 2, depth=2, width=4)  # 3 blocks
  with pytest.raises(ValueError,
                     match=r"num_stages=4 but model 'deep_mlp' has only 3 "
                     r"cuttable block\(s\).*num_stages<=3"):
    plan_stages(model, 4)


def test_more_stages_than_devices(cpu_devices):
  model = demo.deep_mlp((8,), 2, depth=8, width=4)
  with pytest.raises(ValueError, match=r"num_stages=5 but only 4 device\(s\) "
                     r"exist: /device:CPU:0.*pass devices="):
    plan_stages(model, 5)
  with pytest.raises(ValueError, match=r"names 2 device\(s\) for num_stages=3"):
    plan_stages(model, 3, devices=cpu_devices[:2])
  with pytest.raises(ValueError, match=r"device '/gpu:7' does not exist"):
    plan_stages(model, 2, devices=["/cpu:0", "/gpu:7"])


def test_unknown_split_point_lists_the_valid_ones():
  model = demo.deep_mlp((8,), 2, depth=3, width=4)
  with pytest.raises(ValueError, match=r"split point 'hidden_9' is not a layer "
                     r"of model 'deep_mlp'. Valid split points: hidden_1, "
                     r"hidden_2, logits"):
    plan_stages(model, 2, split_points=["hidden_9"])
  # A new user's trial: a layer of a nested Sequential (kept whole) was
  # said to be no layer of the model at all.
  body = keras.Sequential([keras.layers.Dense(4, name="s1"),
                           keras.layers.Dense(4, name="s2")], name="body")
  inputs = keras.Input((4,))
  nested = keras.Model(inputs, keras.layers.Dense(2, name="out")(
      body(keras.layers.Dense(4, name="pre")(inputs))), name="nested")
  with pytest.raises(ValueError, match=r"split point 's2' is inside 'body' "
                     r"\(Sequential\) of model 'nested', which a split keeps "
                     r"whole .* build 'body' as a functional model to cut "
                     r"inside it. Valid split points: body, out"):
    plan_stages(nested, 2, split_points=["s2"])


def test_split_point_inside_a_residual_block_sends_both_tensors():
  model = demo.small_resnet((8, 8, 3), 4, blocks=2, filters=4)
  plan = plan_stages(model, 2, split_points=["block1_conv2"])
  first, second = plan.stages
  assert second.layers[0] == "block1_conv2"
  assert first.sent == ("block0_out", "block1_relu1")
  assert first.sent_bytes == 2 * 8 * 8 * 4 * 4 == second.input_bytes
  assert "2: block0_out, block1_relu1" in plan.table()


@pytest.mark.parametrize("kwargs,match", [
    (dict(split_points=["hidden_1"]), r"has 1 name\(s\) but num_stages=3 "
     r"needs 2"),
    (dict(split_points=["hidden_2", "hidden_1"]), r"distinct and in the "
     r"model's layer order"),
    (dict(split_points=["hidden_0", "hidden_1"]), r"'hidden_0' is the "
     r"model's first layer"),
    (dict(criterion="speed"), r"criterion='speed' is unknown; choose one of "
     r"balanced, params, flops"),
])
def test_bad_options(kwargs, match):
  model = demo.deep_mlp((8,), 2, depth=3, width=4)
  with pytest.raises(ValueError, match=match):
    plan_stages(model, 3, **kwargs)


def test_models_that_cannot_be_split():
  with pytest.raises(ValueError, match=r"is not built"):
    plan_stages(keras.Sequential([keras.layers.Dense(2)]), 1)
  inputs = keras.Input((4,))
  shared = keras.layers.Dense(4, name="shared")
  model = keras.Model(inputs, shared(shared(inputs)))
  # A layer called twice is one node per call, its weights shared between
  # the stages they land on (tfmgpu.parallel.shared), no longer refused.
  plan = plan_stages(model, 2, check_devices=False,
                     devices=["/gpu:0", "/gpu:1"])
  assert plan.layer_names == ("shared", "shared.2")
  assert [w.layers for w in plan.shared] == [("shared", "shared.2")] * 2

  class Subclassed(keras.Model):

    def __init__(self):
      super().__init__(name="sub")
      self.dense = keras.layers.Dense(2)

    def call(self, x):
      return self.dense(x)

  sub = Subclassed()
  sub(np.ones((1, 3), np.float32))
  with pytest.raises(ValueError, match=r"model 'sub' has no symbolic "
                     r"inputs/outputs \(Subclassed\): only Sequential and "
                     r"functional models can be split. Rewrite it"):
    plan_stages(sub, 1)
  with pytest.raises(ValueError, match=r"num_stages=0 must be a positive"):
    plan_stages(demo.deep_mlp((8,), 2, depth=1, width=2), 0)
