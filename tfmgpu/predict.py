r"""Serve a trained model on many devices: `python -m tfmgpu.predict`.

Examples:
  python -m tfmgpu.predict --model_path=runs/demo/model.keras \
      --strategy=mirrored --virtual_devices=2 --output=preds.npy
  python -m tfmgpu.predict --model_path=a.keras,b.keras \
      --strategy=branch_parallel --virtual_devices=2

Prints throughput (examples/s) and, when the dataset has labels, accuracy.
Nothing is written to --output unless every row was predicted.

Exit codes: 0 done; 1 bad input or an error (the message says which); 130
Ctrl-C (--output not written: a file there before is unchanged).
"""

from __future__ import annotations

import os
import sys
import time
import types

from absl import app
from absl import flags
from absl import logging

from tfmgpu import files
from tfmgpu import flags as flags_lib
from tfmgpu import user_code
from tfmgpu.flags import data
from tfmgpu.flags import devices
from tfmgpu.flags import execution
from tfmgpu.flags import serving
from tfmgpu.flags import stages
from tfmgpu.flags import strategy as strategy_flags
from tfmgpu.flags import cli

for _group in (strategy_flags, devices, data, execution, stages, serving):
  flags.adopt_module_key_flags(_group)  # `--help` lists them too.

_MODEL_PATH = serving.MODEL_PATH
_OUTPUT = flags.DEFINE_string(
    "output", None, "Write predictions (float32) to this .npy file; a model "
    "with several outputs writes one .npz of named arrays instead.")
_OUTPUT_KIND = flags_lib.define_choice(
    "output_kind", "logits", ["logits", "probabilities", "classes"],
    "What --output holds for a classifier: its logits, softmax "
    "probabilities, or the class of the highest score (int32).",
    module_name=__name__)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 1024, "Global batch per step.", lower_bound=1)
_PRECISION = flags_lib.define_choice(
    "precision", "float32", ["float32", "bfloat16", "float16"],
    "Compute precision; outputs are float32. Placed models (model_parallel, "
    "pipeline, tensor_parallel, branch_parallel, auto layouts) serve in "
    "float32 only.",
    module_name=__name__)
_SPLIT = flags_lib.define_choice(
    "split", "test", ["test", "train"], "Which part of --dataset to predict.",
    module_name=__name__)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  # Checked here, not with required=True: a required flag would make every
  # parse of the shared flag registry fail in processes that import several
  # CLIs (notebooks, tests).
  if not _MODEL_PATH.value:
    raise app.UsageError("--model_path is required: a .keras file or SavedModel "
                         "directory, e.g. runs/X/model.keras from "
                         "python -m tfmgpu.train --model_dir=runs/X.")
  if _OUTPUT.value:
    problem = check_output(_OUTPUT.value)
    if problem:  # Said now, not after every row is predicted.
      print(f"error: {problem}", file=sys.stderr)
      return 1
  missing = [p for p in _MODEL_PATH.value if not os.path.exists(p)]
  if missing:  # Said before TensorFlow loads (inference.load_model's words).
    print(f"error: model_path={missing[0]!r} does not exist. Train one with "
          "`python -m tfmgpu.train --model_dir=DIR` (it saves "
          "DIR/model.keras).", file=sys.stderr)
    return 1
  flags_lib.quiet_tensorflow()
  try:
    return _predict_and_report()
  except KeyboardInterrupt:  # One line, as train says it: no traceback.
    kept = (f"--output={_OUTPUT.value} was not written (a file there before "
            "is unchanged)" if _OUTPUT.value else "nothing was written")
    print(f"error: interrupted (Ctrl-C): {kept}.", file=sys.stderr)
    return cli.INTERRUPTED_EXIT_CODE


def _predict_and_report() -> int:
  """Loads, predicts every row, reports (and writes `--output`)."""
  try:
    predictor, x, y = _prepare()
    first = predictor.predict(_first_rows(x, _BATCH_SIZE.value))  # Trace.
    if _OUTPUT.value:  # An --output_kind the outputs cannot be: say it now.
      from tfmgpu import inference  # pylint: disable=g-import-not-at-top
      inference.convert_outputs(first, _OUTPUT_KIND.value)
    start = time.perf_counter()
    predictions = predictor.predict(x)
    seconds = time.perf_counter() - start
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    print(f"error: {user_code.describe_error(e)}", file=sys.stderr)
    return 1
  return _report(predictor, predictions, y, seconds)


def _first_rows(x, n: int):
  """The first `n` rows of `x`: an array, or a dict/list/tuple of arrays
  (a user's `--dataset=module:function` for a model with several inputs)."""
  if isinstance(x, dict):
    return {k: _first_rows(v, n) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return type(x)(_first_rows(v, n) for v in x)
  return x[:n]


def check_output(path: str) -> str | None:
  """What is wrong with `--output=path` before predicting (`None`: fine)."""
  if os.path.isdir(path):
    return (f"--output={path!r} is a directory; give a file path, e.g. "
            f"{os.path.join(path, 'predictions.npy')!r}.")
  parent = os.path.dirname(os.path.abspath(path))
  existing = parent
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return (f"--output={path!r} cannot be created: {existing!r} is a file, "
            "not a directory. Choose another path.")
  if not os.access(existing, os.W_OK | os.X_OK):
    return (f"--output={path!r} cannot be written: {existing!r} is not "
            "writable. Choose another path.")
  return None


def _recorded_dataset(model_path: str) -> tuple[str, str | None, str | None]:
  """The dataset (and data path) the run that saved `model_path` trained
  on, and the `run.json` (beside the model or in the run directory) that
  says so; else `digits`, `None`, `None`."""
  from tfmgpu import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu import rundir  # pylint: disable=g-import-not-at-top
  directory = (model_path if os.path.isdir(model_path)
               else os.path.dirname(os.path.abspath(model_path)))
  try:
    record = rundir.read_record(directory) or {}
  except rundir.RunDirError:
    record = {}
  dataset, path = record.get("dataset"), record.get("data_path")
  if not isinstance(dataset, str):
    return config_lib.DEFAULT_DATASET, None, None
  return (dataset, path if isinstance(path, str) else None,
          os.path.join(directory, rundir.RECORD_NAME))


def _load_rows(models):
  """The rows `--dataset` (else the model's run.json) names, as `Arrays`.

  Raises:
    ValueError, FileNotFoundError: the dataset does not load; for a dataset
      read from run.json, the message says so.
  """
  from tfmgpu import data as data_lib  # pylint: disable=g-import-not-at-top
  name, path, record = data.DATASET.value, data.DATA_PATH.value, None
  if not name:
    name, recorded_path, record = _recorded_dataset(_MODEL_PATH.value[0])
    path = path or recorded_path
    if record:
      logging.info("dataset=%r (data_path=%r): from %s.", name, path, record)
  options = {"path": path} if path else {}
  options.update(_options_for_model(name, models[0]))
  try:
    return data_lib.load_dataset(name, **options)
  except (ValueError, FileNotFoundError) as e:
    if not record:
      raise
    raise type(e)(f"{e} (dataset={name!r} is what {record} records for "
                  "this model; give --dataset (and --data_path) to predict "
                  "on other rows.)") from e


def _options_for_model(dataset: str, model) -> dict:
  """Options that make `dataset`'s rows fit `model`: `stdlib_text` windows
  as long as the model's sequences."""
  shape = getattr(model, "input_shape", None)
  if isinstance(shape, dict):
    shape = shape.get("tokens")
  if dataset == "stdlib_text" and isinstance(shape, tuple) and len(shape) == 2:
    return {"seq_len": int(shape[1])}
  return {}


def _prepare():
  """Devices, the models placed for serving, and the rows to predict."""
  from tfmgpu import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  from tfmgpu import strategies as strategies_lib  # pylint: disable=g-import-not-at-top
  values = strategy_flags.values()
  name = values.pop("strategy")
  distribution = strategies_lib.lookup(name)
  devices_lib.configure_virtual_devices(
      devices.VIRTUAL_DEVICES.value,
      intra_op_threads=distribution.intra_op_threads)
  models = [inference.load_model(p) for p in _MODEL_PATH.value]
  options = distribution.options_from(
      types.SimpleNamespace(**values, **stages.values()))
  model, strategy = distribution.serve(models, options)
  arrays = _load_rows(models)
  x, y = ((arrays.x_test, arrays.y_test) if _SPLIT.value == "test"
          else (arrays.x_train, arrays.y_train))
  predictor = inference.Predictor(
      model, strategy=strategy, batch_size=_BATCH_SIZE.value,
      steps_per_execution=execution.STEPS_PER_EXECUTION.value,
      precision=_PRECISION.value)
  return predictor, x, y


def _first_output(predictions):
  """The first output of one array or a list/dict of them."""
  if isinstance(predictions, dict):
    return next(iter(predictions.values()))
  if isinstance(predictions, (list, tuple)):
    return predictions[0]
  return predictions


def _are_class_scores(predictions, y) -> bool:
  """Accuracy means something: one output of class scores, integer labels."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if y is None or not isinstance(predictions, np.ndarray) or not isinstance(
      y, np.ndarray):
    return False
  return (predictions.ndim == 2 and predictions.shape[1] > 1
          and np.issubdtype(y.dtype, np.integer) and y.ndim == 1)


def _report(predictor, predictions, y, seconds: float) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import placed_model  # pylint: disable=g-import-not-at-top
  rows = len(np.asarray(_first_output(predictions)))
  placed = (getattr(predictor.model, "devices", None)
            or getattr(predictor.model, "branch_devices", None))
  where = (f"on {len(set(placed))} devices" if placed_model.is_placed(
      predictor.model) and placed else
           f"{predictor.strategy.num_replicas_in_sync} replica(s)")
  print(f"predicted  {rows} rows with {strategy_flags.STRATEGY.value} "
        f"({where})")
  print(f"throughput {rows / seconds:,.0f} examples/s")
  if _are_class_scores(predictions, y):
    accuracy = float(np.mean(np.argmax(predictions, -1) == y))
    print(f"accuracy   {accuracy:.4f}")
  if _OUTPUT.value:
    try:
      written = inference.save_predictions(
          _OUTPUT.value,
          inference.convert_outputs(predictions, _OUTPUT_KIND.value))
    except OSError as e:
      print(f"error: {files.describe_os_error(e, _OUTPUT.value)}",
            file=sys.stderr)
      return 1
    several = (f" ({len(predictions)} outputs, one array each)"
               if isinstance(predictions, (dict, list, tuple)) else "")
    print(f"output     {written} ({_kind_written(predictions)}){several}")
  return 0


def _kind_written(predictions) -> str:
  """What `--output` holds: `--output_kind`, or, for outputs that are no
  class scores (a regression's), the model's outputs as they are."""
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  kind = _OUTPUT_KIND.value
  if kind == "logits" and not inference.holds_class_scores(
      _first_output(predictions)):
    return "the model's outputs"
  return kind


def run() -> None:
  """Console-script entry point (`tfmgpu-predict`)."""
  cli.run(main, __name__)


class _CliAndFunction(types.ModuleType):
  """`tfmgpu.predict` names both this CLI module and the public function
  `tfmgpu.inference.predict`: whichever Python binds first, calling it
  predicts and `.main` runs the CLI."""

  def __call__(self, *args, **kwargs):
    from tfmgpu import inference  # pylint: disable=g-import-not-at-top
    return inference.predict(*args, **kwargs)


sys.modules[__name__].__class__ = _CliAndFunction

if __name__ == "__main__":
  run()
