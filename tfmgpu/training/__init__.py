"""Training: per-replica steps, the distribution wrapper, the loop, checkpoints."""
