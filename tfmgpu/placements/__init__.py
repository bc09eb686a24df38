"""Placements: distributions that split the model itself over devices.

One module per placement, each registering one `Distribution`
(`tfmgpu.strategies.registry`) that binds an engine of `tfmgpu.parallel` to
training, serving, the run summary, `run.json` and `--plan_only`. `base`
holds what they share: `LayoutOptions` and `LayoutPlacement` (place, serve,
describe, check_config, plan_text, save_model of any data x stages x tensor
layout), of which `model_parallel`, `pipeline` and `tensor_parallel` are
presets, and the unsplit model's build on the host:

* `model_parallel`: consecutive stages on separate devices (`StagedModel`).
* `pipeline`: those stages fed micro-batches (`PipelinedModel`).
* `branch_parallel`: whole sub-models side by side (`BranchParallel`).
* `tensor_parallel`: rule-matched layers sharded over devices
  (`TensorParallelModel`); with `data_parallel`, copies of it. The stage
  placements take `data_parallel` and `tensor_parallel` too
  (`tfmgpu.parallel.hybrid`).
* `sharded`: `mirrored --zero_stage=1|2|3`, the replicas' weights,
  gradients and optimizer slots sharded over their devices
  (`ShardedModel`).
* `auto`: data parallelism, one of the placements above or data-parallel
  copies of one, chosen by the cost model (`tfmgpu.parallel.auto`).

Importing this package registers them without importing TensorFlow: the
engines load when a placement builds or serves.
"""

from tfmgpu.placements import branch_parallel  # pylint: disable=unused-import
from tfmgpu.placements import model_parallel  # pylint: disable=unused-import
from tfmgpu.placements import pipeline  # pylint: disable=unused-import
from tfmgpu.placements import tensor_parallel  # pylint: disable=unused-import
from tfmgpu.placements import sharded  # pylint: disable=unused-import
from tfmgpu.placements import auto  # pylint: disable=unused-import,g-bad-import-order
