"""`auto`: the layout the cost model predicts fastest, among those that fit.

At run time the model is built with weight shapes only, every layout tfmgpu
builds is weighed for the devices found (`tfmgpu.parallel.auto`:
data parallelism over n devices, model parallelism and pipelines over K
stages, micro-batches, schedule, recomputation, tensor parallelism over T
devices, and R data-parallel copies of these), the table and the reason
are logged, and the chosen distribution (`mirrored`, `model_parallel`,
`pipeline` or `tensor_parallel`, with its `data_parallel` and
`tensor_parallel` options) places, serves and describes the model. The choice is a
prediction of the cost model, not a measurement; a layout whose memory
estimate exceeds `device_memory_gb` is never chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

from absl import logging

from tfmgpu import checks
from tfmgpu.parallel import links
from tfmgpu.parallel.choices import PARTITION_CHOICES
from tfmgpu import settings
from tfmgpu.placements import base
from tfmgpu.placements import model_parallel
from tfmgpu.placements import pipeline
from tfmgpu.placements import tensor_parallel
from tfmgpu.settings import setting
from tfmgpu.strategies import data_parallel
from tfmgpu.strategies import registry

# The layouts `tfmgpu.parallel.auto` chooses among, by the name its plan
# gives: held here, so that the choice needs no second registry lookup
# (a run looks `--strategy` up once: `auto`).
_LAYOUTS: dict[str, registry.Distribution] = {
    d.name: d() for d in (data_parallel.Mirrored, model_parallel.ModelParallel,
                          pipeline.Pipeline, tensor_parallel.TensorParallel)}


@dataclasses.dataclass(frozen=True)
class AutoOptions:
  """What `auto` plans for.

  Attributes:
    device_memory_gb: memory budget per device in GB (10^9 bytes); `None`:
      `links.DEFAULT_DEVICE_MEMORY_GB` (16).
    link: a named link between devices (`links.LINK_CHOICES`); `auto`:
      `pcie4` between GPUs, `cpu` between logical CPUs.
    global_batch_size: examples per step (a run's own setting).
    optimizer: the optimizer whose slots the memory estimate counts (a
      run's own setting).
    partition: what stage splits balance.
  """
  device_memory_gb: float | None = setting(
      None, "'auto': memory budget per device in GB; no layout whose "
      "estimate exceeds it is chosen. Default: "
      f"{links.DEFAULT_DEVICE_MEMORY_GB:g}.", lower_bound=0.001)
  link: str = setting(
      "auto", "'auto': the link between devices, for predicted transfer and "
      "all-reduce times (nominal GB/s: "
      + ", ".join(f"{k} {v:g}" for k, v in links.LINK_GBPS.items())
      + "); auto: pcie4 between GPUs, cpu between logical CPUs.",
      choices=links.LINK_CHOICES)
  global_batch_size: int = 64
  optimizer: str = "adam"
  partition: str = settings.with_default(model_parallel.StageOptions,
                                         "partition", "balanced")

  def __post_init__(self):
    if self.device_memory_gb is not None and not self.device_memory_gb > 0:
      raise ValueError(f"device_memory_gb={self.device_memory_gb!r} must be "
                       "> 0 (or None for the default of "
                       f"{links.DEFAULT_DEVICE_MEMORY_GB:g}).")
    checks.check_choice("link", self.link, links.LINK_CHOICES)
    checks.check_positive("global_batch_size", self.global_batch_size)
    checks.check_choice("partition", self.partition, PARTITION_CHOICES)


def hardware_for(options: AutoOptions, devices: Sequence[str]) -> Any:
  """The `tfmgpu.parallel.auto.Hardware` of `devices` under `options`."""
  from tfmgpu.parallel import auto  # pylint: disable=g-import-not-at-top
  kind = "GPU" if any("GPU" in d.upper() for d in devices) else "CPU"
  link, bandwidth = links.link_bandwidth(options.link, kind)
  memory = (options.device_memory_gb if options.device_memory_gb is not None
            else links.DEFAULT_DEVICE_MEMORY_GB)
  return auto.Hardware(len(devices), kind, int(memory * 1e9),
                       links.DEVICE_FLOPS[kind], bandwidth, link,
                       links.TASK_OVERHEAD_S[kind])


def choose(model: Any, options: AutoOptions,
           devices: Sequence[str] | None = None) -> Any:
  """The `tfmgpu.parallel.auto.AutoPlan` for `model` on `devices` (default:
  the accelerator devices found).

  Raises:
    ValueError: no layout fits the memory budget (the message says the
      smallest estimate).
  """
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import auto  # pylint: disable=g-import-not-at-top
  found = list(devices) if devices else devices_lib.accelerator_devices()
  return auto.plan_layout(model, hardware_for(options, found),
                          global_batch_size=options.global_batch_size,
                          optimizer=options.optimizer,
                          partition=options.partition)


def resolve(plan: Any, options: AutoOptions
            ) -> tuple[registry.Distribution, Any]:
  """The chosen distribution and its options."""
  chosen = _LAYOUTS[plan.chosen.strategy]
  values = plan.chosen.options()
  if chosen.name == "mirrored":
    values["single_replica"] = "default"
  elif chosen.name != "tensor_parallel":  # Stages: how to cut them.
    values["partition"] = options.partition
  return chosen, chosen.options(**values)


@registry.register
class Auto(registry.Distribution):
  """The fastest predicted layout that fits, chosen at run time."""
  name = "auto"
  description = ("Chooses data parallelism, model parallelism, a pipeline "
                 "(stages, micro-batches, schedule, recomputation), tensor "
                 "parallelism or data-parallel copies of these by the "
                 "cost model's predicted step time among the layouts whose "
                 "memory estimate fits --device_memory_gb; logs the "
                 "candidates and why.")
  kind = registry.Kind.PLACEMENT
  needs = ("a chain-like Sequential/functional model (to weigh splits); "
           "the devices found")
  Options = AutoOptions
  layout = "replicas or stages"

  def portable(self, options: AutoOptions) -> bool:
    """Unknown before the choice (whole copies write no portable view)."""
    del options
    return False

  def place(self, options: AutoOptions, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    plan = choose(base.build_for_plan(build), options)
    print(plan.table(), flush=True)  # Next to the stage plan runs prints.
    chosen, chosen_options = resolve(plan, options)
    return chosen.place(chosen_options, build, strategy=strategy, seed=seed)

  def serve(self, models: Sequence[Any], options: AutoOptions
            ) -> tuple[Any, Any]:
    plan = choose(base.one_model(self.name, models), options)
    logging.info("%s", plan.table())
    chosen, chosen_options = resolve(plan, options)
    return chosen.serve(models, chosen_options)

  def plan_text(self, model: Any, options: AutoOptions, *,
                global_batch_size: int, optimizer: str,
                input_shape: Any = None) -> str:
    """The layouts weighed and the one chosen; for a causal LM, then the
    weights and KV cache of serving it in the chosen layout
    (`base.serving_text`)."""
    del global_batch_size, optimizer  # The options have them.
    plan = choose(model, options)
    chosen, chosen_options = resolve(plan, options)
    from tfmgpu.parallel import layout as layout_lib  # pylint: disable=g-import-not-at-top
    layout = chosen.layout_of(chosen_options) or layout_lib.Layout(
        data=plan.chosen.devices)  # Mirrored: whole copies.
    from tfmgpu import devices  # pylint: disable=g-import-not-at-top
    names = devices.accelerator_devices()[:layout.stages * layout.tensor]
    serving = base.serving_text(model, layout, options.global_batch_size,
                                input_shape, devices=names)
    return plan.table() if serving is None else (
        f"{plan.table()}\n\n{serving}")
