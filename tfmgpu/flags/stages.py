"""How a model is cut into stages (model_parallel, pipeline, branches)."""

from absl import flags

from tfmgpu import flags as flags_lib
from tfmgpu.placements import model_parallel

NUM_STAGES = flags.DEFINE_integer(
    "num_stages", 2, "Stages for model_parallel/pipeline; branches for "
    "branch_parallel.", lower_bound=1)
PARTITION = flags_lib.define_choice(
    "partition", "balanced", list(model_parallel.PARTITION_CHOICES),
    "Cost that stages are balanced by.",
    module_name=__name__)
SPLIT_POINTS = flags.DEFINE_list(
    "split_points", None, "Explicit stage boundaries (layer names).")
MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", 4, "Micro-batches per step for 'pipeline'.", lower_bound=1)
DATA_PARALLEL = flags.DEFINE_integer(
    "data_parallel", 1, "Data-parallel copies of the staged model "
    "(model_parallel, pipeline) or of the sharded one (tensor_parallel); the "
    "layout uses data_parallel x stages x tensor_parallel devices.",
    lower_bound=1)
TENSOR_PARALLEL = flags.DEFINE_integer(
    "tensor_parallel", 1, "Devices each split layer is sharded over "
    "(Megatron-style: attention by heads, MLP by columns then rows), for "
    "model_parallel, pipeline and tensor_parallel.", lower_bound=1)
TENSOR_RULES = flags.DEFINE_string(
    "tensor_rules", None, "Which layers --tensor_parallel splits, as "
    "'regex=kind,...' on layer names (kinds: column, row, heads), or "
    "'layout_map': a keras_hub model's own layout map (its attention and MLP "
    "kernels inside the blocks). Default: the layout map for keras_hub "
    "models (gpt2, llama, ...), else the gpt rules (*_attention=heads, "
    "*_mlp_up=column, *_mlp_down=row).")


def values() -> dict:
  """The group's parsed values, by option name."""
  return {"num_stages": NUM_STAGES.value, "partition": PARTITION.value,
          "split_points": (tuple(SPLIT_POINTS.value) if SPLIT_POINTS.value
                           else None),
          "micro_batches": MICRO_BATCHES.value,
          "data_parallel": DATA_PARALLEL.value,
          "tensor_parallel": TENSOR_PARALLEL.value,
          "tensor_rules": TENSOR_RULES.value}
