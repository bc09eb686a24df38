"""How a model is spread over devices: stage plans, staged models, pipelines, branches."""

from tfmgpu import strategies as _strategies
from tfmgpu.parallel.branches import BranchParallel
from tfmgpu.parallel.partition import StagePlan
from tfmgpu.parallel.partition import plan_stages
from tfmgpu.parallel.staged import StagedModel

_strategies.register_placement(
    "model_parallel",
    "Model parallelism: consecutive layer stages on separate devices, each "
    "stage's forward and backward on its own device (StagedModel).",
    needs="2+ devices (GPUs, or logical CPUs for testing) and a chain-like "
    "Sequential/functional model")
_strategies.register_placement(
    "branch_parallel",
    "Parallel sub-models (towers, ensemble members) on separate devices on "
    "the same input, outputs combined (BranchParallel).",
    needs="one device per branch (GPUs, or logical CPUs for testing)")
