"""`tensor_parallel`: split layers sharded over devices (Megatron-style).

Layers whose names match the tensor rules are split over `tensor_parallel`
devices: attention by heads, the MLP's first dense layer by columns and its
second by rows, so each block adds its shards' partial sums once in the
forward and once in the backward (`tfmgpu.parallel.tensor`). With
`data_parallel=R`, `R` such copies train as data-parallel replicas
(`tfmgpu.parallel.hybrid`). For stages as well, use `pipeline` or
`model_parallel` with `--tensor_parallel`. A preset of
`tfmgpu.placements.base.LayoutPlacement` that cuts no stages.
"""

from __future__ import annotations

import dataclasses

from tfmgpu import settings
from tfmgpu.placements import base
from tfmgpu.strategies import registry


@dataclasses.dataclass(frozen=True)
class TensorOptions(base.LayoutOptions):
  """Options of `tensor_parallel`: `tensor_parallel` (`T`, devices each
  split layer is sharded over; 2 here), `data_parallel` (`R` copies,
  `R * T` devices in all) and `tensor_rules`."""
  tensor_parallel: int = settings.with_default(base.LayoutOptions,
                                                "tensor_parallel", 2)


@registry.register
class TensorParallel(base.LayoutPlacement):
  """Rule-matched layers sharded over devices, with data-parallel copies."""
  name = "tensor_parallel"
  python_api = "tfmgpu.parallel.tensor.TensorParallelModel"
  description = ("Tensor parallelism: attention split by heads and the MLP "
                 "by columns then rows over --tensor_parallel devices "
                 "(Megatron-LM arrangement: one all-reduce per block each "
                 "way), optionally --data_parallel copies "
                 "(TensorParallelModel).")
  needs = ("--tensor_parallel devices (GPUs, or logical CPUs), and layers "
           "the rules can split (heads and widths divisible by it)")
  Options = TensorOptions
  layout = "shards"
  always_layout_devices = True

  def check_config(self, options: TensorOptions,
                   run: registry.RunFacts) -> None:
    if options.tensor_parallel < 2:
      raise ValueError(
          f"strategy='tensor_parallel' with tensor_parallel="
          f"{options.tensor_parallel} splits nothing: give "
          "--tensor_parallel=T (2 or more devices per split layer).")
    super().check_config(options, run)

  def size_row(self, placement: registry.Placement) -> tuple[str, str]:
    return ("shards",
            f"{placement.options.tensor_parallel} per split layer")
