"""The shape rules of docs/architecture.md that a reader can check by eye,
checked here: every function in tfmgpu/ is at most 60 lines, and every
option of every registered strategy or placement is reachable from a
`TrainConfig` (so from Python, and from the CLI through its flags), and
placed models and placements are asked through their declared contracts
(`placed_model.is_placed`, `Distribution` methods), not with `getattr`."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import tfmgpu
from tfmgpu import strategies
from tfmgpu.config import TrainConfig

PACKAGE = pathlib.Path(tfmgpu.__file__).parent
MAX_FUNCTION_LINES = 60


def test_every_function_is_at_most_60_lines():
  long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} "
                      f"{node.name} ({lines} lines)")
  assert not long, "Functions over 60 lines:\n" + "\n".join(long)


def test_the_trainer_stays_a_thin_front():
  """Issue 25: the Trainer is a front over its runners, not a god object."""
  source = (PACKAGE / "training" / "loop.py").read_text()
  trainer = next(node for node in ast.parse(source).body
                 if isinstance(node, ast.ClassDef) and node.name == "Trainer")
  lines = trainer.end_lineno - trainer.lineno + 1
  assert lines < 200, f"Trainer is {lines} lines"
  assert len(source.splitlines()) < 320


def test_every_registered_option_is_a_config_field():
  config_fields = {f.name for f in dataclasses.fields(TrainConfig)}
  unreachable = {
      name: sorted({f.name for f in dataclasses.fields(d.Options)}
                   - config_fields)
      for name, d in strategies.registered().items()}
  assert not any(unreachable.values()), unreachable


def test_config_hands_each_distribution_its_own_options():
  config = TrainConfig(strategy="pipeline", micro_batches=8, num_stages=3,
                       global_batch_size=64, variable_shards=2)
  assert config.options == strategies.lookup("pipeline").options(
      num_stages=3, micro_batches=8)
  assert TrainConfig(strategy="parameter_server",
                     variable_shards=2).options.variable_shards == 2
  assert TrainConfig(strategy="central_storage", parameter_device="/cpu:1"
                     ).options.parameter_device == "/cpu:1"
  assert TrainConfig(strategy="tpu", tpu="grpc://x").options.tpu == "grpc://x"


# Attributes of placed models and placements that callers used to probe.
_PROBED = {"places_itself", "to_unsplit", "compute_loss_and_gradients",
           "branches", "hybrid", "micro_batches", "micro_batches_of",
           "stages", "schedule", "recompute", "num_stages", "split_points",
           "partition", "data_parallel", "tensor_parallel", "tensor_rules",
           "source_dtype_policy"}
# Where they are declared, and the benchmarks, which drive the engines' own
# classes.
_DECLARING = ("placements/", "parallel/", "strategies/registry.py",
              "benchmarks/")


def test_placements_are_asked_through_their_contracts():
  probes = []
  for path in sorted(PACKAGE.rglob("*.py")):
    where = str(path.relative_to(PACKAGE))
    if where.startswith(_DECLARING):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
          and isinstance(node.args[1], ast.Constant)
          and node.args[1].value in _PROBED):
        probes.append(f"tfmgpu/{where}:{node.lineno} {node.func.id}(..., "
                      f"{node.args[1].value!r})")
  assert not probes, "Ask through the contracts:\n" + "\n".join(probes)
