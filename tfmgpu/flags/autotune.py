"""`--autotune`: measure the options that matter here and use the fastest."""

from absl import flags

AUTOTUNE = flags.DEFINE_bool(
    "autotune", None, "Time short runs of input_mode, steps_per_execution, "
    "jit_compile, gradient_compression and batch_splits (one option "
    "changed at a time, "
    "then the winners together) and use the fastest; a change must be 5% "
    "faster. Cached per CPU model, cores, TensorFlow version, model and "
    "replica count in the tfmgpu cache directory (TFMGPU_CACHE_DIR). "
    "Default: off for train, on for bench (--autotune=false turns it "
    "off).")


def enabled(default: bool) -> bool:
  """`--autotune`'s value, or this CLI's `default` when it was not given."""
  return default if AUTOTUNE.value is None else AUTOTUNE.value
