"""The names a stage split, a pipeline schedule and a tensor split accept:
the one list of each.

`tfmgpu.parallel.cost.Criterion` and `tfmgpu.parallel.schedule.Schedule` are
the typed views of these names (a test holds them equal); the placements'
options and the command-line flags take their choices from here, and the
tensor engine and the accounting their default rules.

Pure Python: importing this module does not import TensorFlow, so the flag
definitions can list the choices before TensorFlow loads.
"""

# What `plan_stages` balances (`tfmgpu.parallel.cost.Criterion`).
PARTITION_CHOICES = ("balanced", "params", "flops")

# The order in which each stage runs its micro-batches
# (`tfmgpu.parallel.schedule.Schedule`).
SCHEDULE_CHOICES = ("gpipe", "1f1b")

# How tensor parallelism splits a layer: a Dense by output columns or by
# input rows, a MultiHeadAttention by heads (`tfmgpu.parallel.tensor`).
TENSOR_KINDS = ("column", "row", "heads")

# The default tensor-parallel rules, `{layer name regex: kind}` (the first
# whose regex fully matches a layer's name applies): `tfmgpu.models.gpt`'s
# attention by heads, its MLP's first Dense by columns and second by rows,
# so each block needs one all-reduce forward and one backward. The tensor
# engine and the accounting both read them from here.
TENSOR_RULES_GPT = {r".*_attention": "heads",
                    r".*_mlp_up": "column",
                    r".*_mlp_down": "row"}
