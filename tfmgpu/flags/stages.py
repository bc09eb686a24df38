"""How a model is cut into stages (model_parallel, pipeline, branches)."""

from absl import flags

from tfmgpu.placements import model_parallel

NUM_STAGES = flags.DEFINE_integer(
    "num_stages", 2, "Stages for model_parallel/pipeline; branches for "
    "branch_parallel.", lower_bound=1)
PARTITION = flags.DEFINE_enum(
    "partition", "balanced", list(model_parallel.PARTITION_CHOICES),
    "Cost that stages are balanced by.")
SPLIT_POINTS = flags.DEFINE_list(
    "split_points", None, "Explicit stage boundaries (layer names).")
MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", 4, "Micro-batches per step for 'pipeline'.", lower_bound=1)


def values() -> dict:
  """The group's parsed values, by option name."""
  return {"num_stages": NUM_STAGES.value, "partition": PARTITION.value,
          "split_points": (tuple(SPLIT_POINTS.value) if SPLIT_POINTS.value
                           else None),
          "micro_batches": MICRO_BATCHES.value}
