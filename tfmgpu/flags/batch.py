"""`--global_batch_size`: examples per step over all replicas."""

from absl import flags

GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 64, "Examples per step over all replicas.",
    lower_bound=1)
