"""`branch_parallel`: whole sub-models side by side, outputs combined.

Each branch (a tower, an ensemble member) lives on its own device and sees
the same input (`BranchParallel` of `tfmgpu.parallel.branches`). Trained from
a config, the branches are independently initialised copies of one model,
averaged: an ensemble.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

from tfmgpu import checks
from tfmgpu._lazy import LazyModule
from tfmgpu import settings
from tfmgpu.placements import base
from tfmgpu.placements import model_parallel
from tfmgpu.strategies import registry

tf = LazyModule("tensorflow")
keras = LazyModule("keras")
devices_lib = LazyModule("tfmgpu.devices")


@dataclasses.dataclass(frozen=True)
class BranchOptions:
  """Options of `branch_parallel`.

  Attributes:
    num_stages: branches to train (one device each); the CLI's
      `--num_stages`.
  """
  num_stages: int = settings.with_default(model_parallel.StageOptions,
                                          "num_stages", 2)

  def __post_init__(self):
    checks.check_positive("num_stages", self.num_stages)


@registry.register
class BranchParallelPlacement(registry.Distribution):
  """Sub-models on separate devices, run at the same time."""
  name = "branch_parallel"
  python_api = "tfmgpu.BranchParallel"
  description = ("Parallel sub-models (towers, ensemble members) on separate "
                 "devices on the same input, outputs averaged (an ensemble; "
                 "BranchParallel(combine=...) in Python chooses).")
  kind = registry.Kind.PLACEMENT
  needs = "one device per branch (GPUs, or logical CPUs for testing)"
  Options = BranchOptions
  layout = "branches"

  def place(self, options: BranchOptions, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> registry.Placement:
    from tfmgpu.parallel import branches  # pylint: disable=g-import-not-at-top
    del strategy
    devices = devices_lib.accelerator_devices()
    n = options.num_stages
    if n > len(devices):
      raise ValueError(
          f"branch_parallel with num_stages={n} needs one device per branch "
          f"but only {len(devices)} exist ({', '.join(devices)}). Use "
          "--virtual_devices or fewer branches.")
    members = []
    for i in range(n):
      keras.utils.set_random_seed(seed + i)
      members.append(base.build_unsplit(build))
    model = branches.BranchParallel(members, devices=devices[:n],
                                    combine="mean")
    return registry.Placement(tf.distribute.get_strategy(), devices[:n],
                              model, distribution=self, options=options)

  def describe(self, placement: registry.Placement) -> list[tuple[str, str]]:
    (row,) = super().describe(placement)
    return [(row[0], f"{row[1]} (num_stages={placement.options.num_stages}: "
             "one independently initialised member each, averaged)")]

  def save_model(self, model: Any, path: str) -> str:
    """Saves each branch, one file each (`model.branch0.keras`, ...), which
    `python -m tfmgpu.predict --strategy=branch_parallel --model_path=a,b`
    serves side by side; returns the paths, comma-separated."""
    stem = path[:-len(".keras")] if path.endswith(".keras") else path
    paths = [f"{stem}.branch{i}.keras" for i in range(len(model.branches))]
    for branch, branch_path in zip(model.branches, paths):
      super().save_model(branch, branch_path)
    return ",".join(paths)

  def serve(self, models: Sequence[Any], options: Any) -> tuple[Any, Any]:
    from tfmgpu.parallel import branches  # pylint: disable=g-import-not-at-top
    del options
    if len(models) < 2:
      raise ValueError("branch_parallel serves 2+ models side by side (one "
                       f"model path per branch); got {len(models)}.")
    base.keras_models_only(self.name, models)
    devices = devices_lib.accelerator_devices()
    if len(models) > len(devices):  # BranchParallel's words are Python's.
      raise ValueError(
          f"branch_parallel serves each model on its own device: "
          f"{len(models)} model paths but only {len(devices)} device(s) "
          f"exist ({', '.join(devices)}). Pass --virtual_devices="
          f"{len(models)} (logical CPUs) or fewer --model_path entries.")
    return branches.BranchParallel([base.served_view(m) for m in models],
                                   devices=devices[:len(models)],
                                   combine="mean"), None
