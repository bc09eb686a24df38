"""The plan's memory estimate, part by part, against counts made by hand:
weights, gradients, optimizer slots, and activations per micro-batch in
flight (GPipe and 1F1B, with and without recomputation)."""

import dataclasses
import importlib.util
import pathlib

import keras
import pytest

from tfmgpu.models import gpt
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import partition
from tfmgpu.parallel import plan as plan_lib

L = keras.layers
BATCH = 8


def _model():
  """x (4 floats) -> d0 (3) -> bn -> d1 (2) -> d2 (5); cut before d1."""
  keras.utils.set_random_seed(0)
  return keras.Sequential([
      keras.Input((4,)),
      L.Dense(3, name="d0"),
      L.BatchNormalization(name="bn"),
      L.Dense(2, name="d1"),
      L.Dense(5, name="d2"),
  ], name="by_hand")


@pytest.fixture(scope="module")
def plan():
  return partition.plan_stages(_model(), 2, split_points=["d1"],
                               devices=["/cpu:0", "/cpu:1"])


# The counts, by hand (float32: 4 bytes an element; per example):
# stage 0 = d0, bn.
#   weights: d0 4*3 + 3 = 15, bn gamma, beta, mean, variance 4*3 = 12:
#     27 floats = 108 B; trainable: 15 + 6 (gamma, beta) = 21 floats = 84 B.
#   input: x, 4 floats = 16 B; layer outputs: d0 3 + bn 3 = 6 floats = 24 B.
# stage 1 = d1, d2.
#   weights (all trainable): d1 3*2 + 2 = 8, d2 2*5 + 5 = 15: 23 floats = 92 B.
#   input: bn's output, 3 floats = 12 B; outputs: d1 2 + d2 5 = 7 floats = 28 B.
# Adam: 2 slots per trainable weight: 168 B and 184 B.
# Batch 8 in M = 4 micro-batches of 2 examples.
#   In flight: GPipe 4 on both stages; 1F1B min(K - k, M): 2 and 1.
#   Without recompute: in flight * 2 * (input + outputs):
#     GPipe  stage 0: 4 * 2 * (16 + 24) = 320, stage 1: 4 * 2 * (12 + 28) = 320
#     1F1B   stage 0: 2 * 2 * 40 = 160,        stage 1: 1 * 2 * 40 = 80
#   With recompute: 2 * (in flight * input + outputs of one micro-batch):
#     GPipe  stage 0: 2 * (4 * 16 + 24) = 176,  stage 1: 2 * (4 * 12 + 28) = 152
#     1F1B   stage 0: 2 * (2 * 16 + 24) = 112,  stage 1: 2 * (1 * 12 + 28) = 80
#   One micro-batch (a StagedModel): 8 * (16 + 24) = 320 and 8 * 40 = 320.
ACTIVATIONS = {
    ("gpipe", False): (320, 320), ("1f1b", False): (160, 80),
    ("gpipe", True): (176, 152), ("1f1b", True): (112, 80)}
IN_FLIGHT = {"gpipe": (4, 4), "1f1b": (2, 1)}


def test_the_stages_hold_what_the_hand_count_says(plan):
  s0, s1 = plan.stages
  assert (s0.param_bytes, s0.trainable_param_bytes) == (108, 84)
  assert (s0.input_bytes, s0.activation_bytes) == (16, 24)
  assert (s1.param_bytes, s1.trainable_param_bytes) == (92, 92)
  assert (s1.input_bytes, s1.activation_bytes) == (12, 28)


@pytest.mark.parametrize("schedule,recompute", list(ACTIVATIONS))
def test_each_part_matches_the_hand_count(plan, schedule, recompute):
  mem = plan.memory_estimate(BATCH, optimizer="adam", micro_batches=4,
                             schedule=schedule, recompute=recompute)
  assert list(mem) == ["/device:CPU:0", "/device:CPU:1"]
  e0, e1 = mem.values()
  assert (e0.weights, e0.gradients, e0.optimizer_slots) == (108, 84, 168)
  assert (e1.weights, e1.gradients, e1.optimizer_slots) == (92, 92, 184)
  assert (e0.activations, e1.activations) == ACTIVATIONS[(schedule,
                                                          recompute)]
  assert (e0.in_flight, e1.in_flight) == tuple(
      (f,) for f in IN_FLIGHT[schedule])
  assert e0.total == 108 + 84 + 168 + ACTIVATIONS[(schedule, recompute)][0]


def test_one_micro_batch_is_the_staged_model_and_sgd_has_no_slots(plan):
  e0, e1 = plan.memory_estimate(BATCH, optimizer="sgd").values()
  assert (e0.activations, e1.activations) == (320, 320)
  assert e0.optimizer_slots == e1.optimizer_slots == 0
  assert plan.memory_estimate(BATCH, optimizer=3)[
      "/device:CPU:1"].optimizer_slots == 3 * 92


def test_stages_sharing_a_device_add_up():
  shared = partition.plan_stages(_model(), 2, split_points=["d1"],
                                 devices=["/cpu:1", "/cpu:1"])
  (e,) = shared.memory_estimate(BATCH, micro_batches=4, schedule="1f1b",
                                recompute=True).values()
  assert (e.weights, e.gradients, e.optimizer_slots) == (200, 176, 352)
  assert e.activations == 112 + 80 and e.in_flight == (2, 1)


def test_1f1b_holds_at_most_k_minus_stage_index_micro_batches():
  flight = plan_lib.micro_batches_in_flight
  assert [flight("1f1b", 4, k, 8) for k in range(4)] == [4, 3, 2, 1]
  assert [flight("1f1b", 4, k, 2) for k in range(4)] == [2, 2, 2, 1]
  assert [flight("gpipe", 4, k, 8) for k in range(4)] == [8] * 4
  with pytest.raises(ValueError, match="schedule='zigzag' is unknown"):
    flight("zigzag", 4, 0, 8)


def test_the_memory_table_prints_every_part(plan):
  text = plan.memory_table(BATCH, optimizer="adam", micro_batches=4,
                           schedule="gpipe", recompute=True)
  lines = text.splitlines()
  assert lines[0] == ("Estimated training memory per device (batch 8 = 4 "
                      "micro-batches of 2, gpipe, recompute, adam optimizer "
                      "slots):")
  assert lines[1].split() == ["device", "weights", "grads", "slots",
                              "activations", "in", "flight", "total"]
  # 108 + 84 + 168 + 176 = 536; 92 + 92 + 184 + 152 = 520.
  assert lines[2].split() == ["/device:CPU:0", "108", "B", "84", "B", "168",
                              "B", "176", "B", "4", "536", "B"]
  assert lines[3].split() == ["/device:CPU:1", "92", "B", "92", "B", "184",
                              "B", "152", "B", "4", "520", "B"]
  assert lines[4].split() == ["max", "536", "B"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(micro_batches=3), "batch_size=8 must divide into micro_batches=3"),
    (dict(micro_batches=0), "micro_batches=0 must be a positive int"),
    (dict(schedule="zigzag"), "schedule='zigzag' is unknown"),
    (dict(optimizer="sgdx"), "optimizer='sgdx' is unknown")])
def test_bad_settings_are_named(plan, kwargs, message):
  with pytest.raises(ValueError, match=message):
    plan.memory_estimate(BATCH, **kwargs)


def test_a_shapes_only_model_plans_like_a_real_one_and_stays_empty():
  build = lambda: gpt.gpt((16,), 64, size="tiny", num_layers=3)
  empty = graph_lib.shapes_only(build)
  real = build()  # Keras fills in deferred weights when a model is built.
  assert all(v._value is None for v in empty.weights)  # pylint: disable=protected-access
  devices = ["/cpu:0", "/cpu:1"]
  want, got = (partition.plan_stages(m, 2, devices=devices)
               for m in (real, empty))
  assert got == dataclasses.replace(want, model_name=got.model_name)
  assert sum(s.param_bytes for s in got.stages) == 4 * real.count_params()


def test_the_gpt_memory_script_tabulates_the_estimate():
  """scripts/gpt_memory.py, which makes docs/memory.md's table."""
  path = pathlib.Path(__file__).parents[2] / "scripts" / "gpt_memory.py"
  spec = importlib.util.spec_from_file_location("gpt_memory", path)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  text = script.markdown(["gpt2_small"], [2], seq_len=64, batch=4,
                         micro_batches=2, optimizer="adam")
  lines = text.splitlines()
  assert len(lines) == 3 and lines[0].startswith("| size | params | K |")
  cells = [c.strip() for c in lines[2].strip("|").split("|")]
  plan = script.plan(script.build("gpt2_small", 64), 2)
  gib = lambda n: f"{n / 2**30:.2f}"
  big = max(plan.memory_estimate(4).values(), key=lambda e: e.weights)
  totals = [max(e.total for e in plan.memory_estimate(
      4, micro_batches=2, schedule=s, recompute=r).values())
            for s in ("gpipe", "1f1b") for r in (False, True)]
  assert cells[:3] == ["gpt2_small", "85M", "2"]  # 85.5M at T = 64.
  assert cells[3:6] == [gib(big.weights), gib(big.gradients),
                        gib(big.optimizer_slots)]
  assert cells[7:] == [gib(t) for t in (totals[0], totals[1], totals[2],
                                        totals[3])]
  assert float(cells[3]) > 0.1
