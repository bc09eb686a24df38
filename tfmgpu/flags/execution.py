"""`--steps_per_execution`: steps (or batches) per `tf.function` call."""

from absl import flags

STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", 10, "Steps per tf.function call.", lower_bound=1)
