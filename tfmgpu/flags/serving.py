"""`--model_path`: the trained model a serving CLI loads."""

from absl import flags

MODEL_PATH = flags.DEFINE_list(
    "model_path", None, "A .keras file or SavedModel directory (several, "
    "comma-separated, for --strategy=branch_parallel). Required.")
