"""`plan_serving`: the layout to generate with, by latency or throughput,
never one whose weights and KV cache exceed the budget."""

import pytest

from tfmgpu import models
from tfmgpu.parallel import accounting
from tfmgpu.parallel import kv_cache
from tfmgpu.parallel import serve_plan


@pytest.fixture(scope="module")
def gpt():
  return models.build_model("gpt", input_shape=(24,), num_classes=50,
                            seed=3)


def _hardware(memory_bytes):
  return accounting.Hardware(4, "GPU", memory_bytes, 1e12, 1e10, "link",
                             1e-5)


def test_latency_picks_the_shortest_step_that_fits(gpt):
  weighed = serve_plan.weigh_serving(gpt, _hardware(10**9), batch=8,
                                     context=24)
  chosen = serve_plan.plan_serving(gpt, _hardware(10**9), batch=8,
                                   context=24)
  assert chosen == weighed[0] and chosen.fits and chosen.rows == 8
  assert chosen.step_s == min(c.step_s for c in weighed)
  layouts = {(c.data, c.stages, c.tensor) for c in weighed}
  assert {(1, 1, 1), (2, 1, 2), (1, 2, 2), (4, 1, 1)} <= layouts


def test_throughput_serves_more_rows_where_the_cache_fits(gpt):
  weights = sum(w.numpy().nbytes for w in gpt.weights)
  per_row = sum(kv_cache.per_device(gpt, _one(), batch=1,
                                    context=24).values())
  budget = weights + 6 * per_row  # One device holds about 6 rows.
  weighed = serve_plan.weigh_serving(gpt, _hardware(budget), batch=64,
                                     context=24, goal="throughput")
  alone = next(c for c in weighed if c.label == "one device")
  chosen = weighed[0]
  assert alone.fits and alone.rows < 64
  assert chosen.fits and chosen.rows > alone.rows
  assert chosen.tokens_per_s == max(c.tokens_per_s for c in weighed
                                    if c.fits)


def _one():
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  return hybrid.Layout()


def test_errors_name_the_goal_and_the_smallest_need(gpt):
  with pytest.raises(ValueError, match="goal='fast' is unknown"):
    serve_plan.weigh_serving(gpt, _hardware(10**9), batch=1, context=24,
                             goal="fast")
  with pytest.raises(ValueError, match="no layout of 4 device.*needs"):
    serve_plan.plan_serving(gpt, _hardware(1000), batch=1, context=24)
