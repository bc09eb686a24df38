"""`tensor_parallel`: split layers sharded over devices (Megatron-style).

Layers whose names match the tensor rules are split over `tensor_parallel`
devices: attention by heads, the MLP's first dense layer by columns and its
second by rows, so each block adds its shards' partial sums once in the
forward and once in the backward (`tfmgpu.parallel.tensor`). With
`data_parallel=R`, `R` such copies train as data-parallel replicas
(`tfmgpu.parallel.hybrid`). For stages as well, use `pipeline` or
`model_parallel` with `--tensor_parallel`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from tfmgpu import checks
from tfmgpu._lazy import LazyModule
from tfmgpu.placements import model_parallel
from tfmgpu.strategies import registry

tf = LazyModule("tensorflow")


@dataclasses.dataclass(frozen=True)
class TensorOptions:
  """Options of `tensor_parallel`.

  Attributes:
    tensor_parallel: `T`, devices each split layer is sharded over.
    data_parallel: `R`, data-parallel copies (`R * T` devices in all).
    tensor_rules: which layers split and how, `"regex=kind,..."`
      (`None`: the GPT rules).
  """
  tensor_parallel: int = 2
  data_parallel: int = 1
  tensor_rules: str | None = None

  def __post_init__(self):
    checks.check_positive("tensor_parallel", self.tensor_parallel)
    checks.check_positive("data_parallel", self.data_parallel)

  stages = 1
  hybrid = True

  @property
  def devices_needed(self) -> int:
    return self.data_parallel * self.tensor_parallel


@registry.register
class TensorParallel(registry.Distribution):
  """Rule-matched layers sharded over devices, with data-parallel copies."""
  name = "tensor_parallel"
  python_api = "tfmgpu.parallel.tensor.TensorParallelModel"
  description = ("Tensor parallelism: attention split by heads and the MLP "
                 "by columns then rows over --tensor_parallel devices "
                 "(Megatron-LM arrangement: one all-reduce per block each "
                 "way), optionally --data_parallel copies "
                 "(TensorParallelModel).")
  kind = registry.Kind.PLACEMENT
  needs = ("--tensor_parallel devices (GPUs, or logical CPUs), and layers "
           "the rules can split (heads and widths divisible by it)")
  Options = TensorOptions
  concurrent_devices = True
  layout = "shards"

  def check_config(self, options: TensorOptions,
                   run: registry.RunSettings) -> None:
    if options.tensor_parallel < 2:
      raise ValueError(
          f"strategy='tensor_parallel' with tensor_parallel="
          f"{options.tensor_parallel} splits nothing: give "
          "--tensor_parallel=T (2 or more devices per split layer).")
    model_parallel.check_layout_config(run, options)

  def split(self, model: Any, options: TensorOptions) -> Any:
    from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
    return hybrid.build_layout(
        model, model_parallel.layout_of(options, None),
        devices=model_parallel.layout_devices(options),
        rules=model_parallel.tensor_rules(options))

  def place(self, options: TensorOptions, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    del strategy, seed  # The shards run under the default strategy.
    placed = self.split(model_parallel.build_unsplit(build), options)
    return registry.Placement(
        tf.distribute.get_strategy(), list(placed.devices), placed, None,
        distribution=self, options=options)

  def serve(self, models: Sequence[Any], options: TensorOptions
            ) -> tuple[Any, Any]:
    return self.split(model_parallel.one_model(self.name, models),
                      options), None

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    o = placement.options
    return [("shards", f"{o.tensor_parallel} per split layer"),
            ("layout", model_parallel.hybrid_label(o) + f" on "
             f"{o.devices_needed} devices (replica-major, tensor shards "
             "innermost): " + ", ".join(placement.devices))]
