"""StagePlan: frozen, printable, and its per-device memory estimate."""

import dataclasses

import pytest

from tfmgpu.models import demo
from tfmgpu.parallel import partition

plan_stages = partition.plan_stages


def test_plan_is_frozen_printable_and_estimates_memory(cpu_devices):
  model = demo.deep_mlp((32,), 10, depth=4, width=64)
  plan = plan_stages(model, 2, criterion="params")
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.criterion = "flops"  # type: ignore[misc]
  text = str(plan)
  assert text == plan.table()
  for device in plan.devices:
    assert device in text
  assert "hidden_0" in text and "logits" in text and "total" in text

  mem = plan.memory_estimate(16, optimizer="adam")
  assert list(mem) == list(plan.devices)
  for stage in plan.stages:
    est = mem[stage.device]
    assert est.weights == stage.param_bytes
    assert est.optimizer_slots == 2 * stage.trainable_param_bytes
    assert est.activations == 16 * (stage.input_bytes + stage.activation_bytes)
    assert est.total == (est.weights + est.gradients + est.optimizer_slots +
                         est.activations)
  shared = plan_stages(model, 2, devices=["/cpu:1", "/cpu:1"])
  assert list(shared.memory_estimate(16)) == ["/device:CPU:1"]
  assert shared.memory_estimate(16)["/device:CPU:1"].weights == sum(
      s.param_bytes for s in shared.stages)
