"""How a model is spread over devices, one idea per module (a module imports
only modules listed before it):

* `choices`: the partition criteria and schedule names (no TensorFlow);
* `schedule`: pipeline schedules (GPipe, 1F1B): each stage's task order
  (no TensorFlow);
* `layout`: `Layout`, the sizes of a data x pipeline x tensor layout and
  its device mesh (no TensorFlow);
* `placed_model`: the `PlacedModel` protocol and `is_placed`, what callers
  may ask of a placed model (no TensorFlow);
* `graph`: a Keras model's layer calls in topological order and the tensors
  that cross a cut before any of them (activations, skip tensors, inputs);
* `block_flops`: forward FLOPs and kept activations inside custom layers
  (keras_hub's transformer blocks: their matmuls and attention's `T^2`
  terms);
* `cost`: the cost model: parameter bytes, forward FLOPs and activation bytes
  of each layer, and the bytes crossing each cut;
* `plan`: the `StagePlan`: which layers go to which device, with their
  costs, printable, with a per-device memory estimate;
* `microbatch`: splitting a batch, adding micro-batch gradients and losses;
* `placed`: the base class of every placement, a model whose parts each run
  their backward on their own device, and its shared helpers;
* `shared`: weights several layers hold (tied embeddings): found, kept one
  variable in every copy, their gradients summed over every use;
* `layer_state`: what every copy takes from the original that its config
  leaves out: frozen layers and weights, LoRA, lookup vocabularies;
* `cloning`: rebuilding a model's layers elsewhere: `ModelSpec`,
  `clone_layer`, `stage_inputs`, weights by layer name, `UnsplitWeights`;
* `partition`: `plan_stages`, the exact balanced split of the blocks into
  stages (`min_max_partition`);
* `inspection`: `op_placements`, the device every op of a traced function
  asks for (to check placement);
* `staged`: `StagedModel`, model parallelism along a stage plan;
* `timeline`: a pipelined step's timeline: simulated, summarised, drawn;
* `pipeline_step`: the ops of one pipelined training step, in schedule order;
* `pipeline`: `PipelinedModel`, micro-batches streamed through the stages;
* `branches`: `BranchParallel`, parallel sub-models on one input;
* `on_device`: a computation with its forward and backward on one device;
* `shards`: `ShardedLayer`, the base of the split layers: shards on their
  devices, weights (and `.keras` files) in the unsplit layer's form;
* `activations`: which activations act on each element alone (a shard
  applies them to its slice);
* `split_dense`: `ColumnParallelDense`, `RowParallelDense`;
* `split_attention`: `HeadParallelAttention` (heads split over devices);
* `tensor_rules`: which whole layers split and how (`{regex: kind}`);
* `tensor`: `tensor_parallel` (a model rebuilt with split layers) and
  `TensorParallelModel`;
* `split_mlp`: column outputs kept on their shards for the row kernel
  reading them (a block's MLP: one sum);
* `split_kernel`: `SplitKernelDense`, one kernel split along one axis;
* `split_embedding`: `VocabParallelEmbedding`, an embedding and its
  reversed LM head split by vocabulary rows;
* `split_hub_attention`: keras_hub's attention layers split by heads in
  place (each shard's heads, rotary, scores and cache on its device);
* `split_blocks`: the weights a layout names split in place inside blocks;
* `layout_maps`: tensor parallelism from a Keras `LayoutMap` (or path
  rules): `{variable path: axis}` of the weights to split;
* `replicated`: `ReplicatedModel`, data-parallel copies of a placed model,
  gradients summed per group of devices holding the same part;
* `hybrid`: `build_layout`, data x pipeline x tensor meshes (`Layout`
  re-exported);
* `zero_memory`: per-device bytes held and sent under ZeRO stages 0-3;
* `zero_shards`: where a ZeRO model's state lives: owners balanced by
  bytes, reads on the owner, stage 1-2 copies, bytes per device;
* `zero`: `ShardedModel`, data parallelism with weights, gradients and
  optimizer slots sharded over the replica devices (ZeRO stages 1-3);
* `zero_placement`: `Trainer(zero_stage=N)`: a model sharded over its
  strategy's devices (or every local one);
* `zero_collectives`: between-graph ZeRO pieces: the owners' values
  all-gathered, a stage-1 update with slots on their owner only (the CLI
  runs multi-worker ZeRO in-graph instead: `tfmgpu.in_graph`);
* `links`: named link bandwidths, device speeds, GPU hosts, the default
  memory budget (no tfmgpu imports);
* `accounting`: a layout's per-device memory, bytes sent per kind of
  parallelism and projected step;
* `calibration`: the cost model's machine figures measured on this host
  (training FLOP/s, per-task and per-send costs, devices sharing cores),
  cached per host: what a placed run's predicted step uses;
* `kv_cache`: text generation's KV-cache bytes per device of a layout,
  beside the weights (`serving_table`);
* `serve_plan`: `plan_serving`, the layout to generate with (latency or
  throughput), weights and KV cache within the memory;
* `zero_cost`: the ZeRO stages as `auto` weighs them (variants of a
  data-parallel candidate);
* `auto`: `plan_layout`, the fastest predicted layout that fits in memory.

These are the engines; this package registers no names. The placements
that train and serve with them (`model_parallel`, `pipeline`,
`branch_parallel`, `tensor_parallel`, `sharded`, `auto`) are the modules of
`tfmgpu.placements`, each registered in `tfmgpu.strategies.registry`, the
one list of names. Importing this package does not import TensorFlow: the
public names below resolve on first use, like `tfmgpu`'s own.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BranchParallel": "tfmgpu.parallel.branches",
    "Layout": "tfmgpu.parallel.layout",
    "PipelinedModel": "tfmgpu.parallel.pipeline",
    "ReplicatedModel": "tfmgpu.parallel.replicated",
    "ShardedModel": "tfmgpu.parallel.zero",
    "StagePlan": "tfmgpu.parallel.plan",
    "StagedModel": "tfmgpu.parallel.staged",
    "TensorParallelModel": "tfmgpu.parallel.tensor",
    "Timeline": "tfmgpu.parallel.timeline",
    "build_layout": "tfmgpu.parallel.hybrid",
    "plan_stages": "tfmgpu.parallel.partition",
    "simulate": "tfmgpu.parallel.timeline",
    "tensor_parallel": "tfmgpu.parallel.tensor",
    "theoretical_bubble": "tfmgpu.parallel.schedule",
}
_SUBMODULES = ("accounting", "activations", "auto", "block_flops",
               "branches", "calibration", "choices",
               "cloning", "cost", "graph", "hybrid", "inspection", "kv_cache",
               "layer_state", "layout", "layout_maps", "links", "microbatch", "on_device",
               "partition", "pipeline", "pipeline_step", "placed",
               "placed_model", "plan", "replicated", "schedule", "serve_plan",
               "shards", "shared", "split_attention", "split_blocks",
               "split_dense", "split_embedding", "split_hub_attention",
               "split_kernel", "split_mlp", "staged",
               "tensor", "tensor_rules", "timeline", "zero", "zero_cost",
               "zero_collectives", "zero_memory", "zero_placement",
               "zero_shards")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _SUBMODULES:
    return importlib.import_module(f"tfmgpu.parallel.{name}")
  if name not in _EXPORTS:
    raise AttributeError(f"module 'tfmgpu.parallel' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__ + list(_SUBMODULES))
