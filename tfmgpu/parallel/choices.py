"""The names a stage split and a pipeline schedule accept: the one list of each.

`tfmgpu.parallel.cost.Criterion` and `tfmgpu.parallel.schedule.Schedule` are
the typed views of these names (a test holds them equal); the placements'
options and the command-line flags take their choices from here.

Pure Python: importing this module does not import TensorFlow, so the flag
definitions can list the choices before TensorFlow loads.
"""

# What `plan_stages` balances (`tfmgpu.parallel.cost.Criterion`).
PARTITION_CHOICES = ("balanced", "params", "flops")

# The order in which each stage runs its micro-batches
# (`tfmgpu.parallel.schedule.Schedule`).
SCHEDULE_CHOICES = ("gpipe", "1f1b")
