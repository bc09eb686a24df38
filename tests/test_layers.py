"""The package's layers hold: no module imports from a higher layer.

Every module under tfmgpu/ is parsed (never imported) and each `tfmgpu.*`
import it makes -- at module level or inside a function, including
`LazyModule("tfmgpu.x")` and `importlib.import_module("tfmgpu.x")` -- is
checked against `LAYERS`. Only the command-line layer may use `absl.flags`.
No modules import each other in a circle, even within a layer.
Each test lists every violation at once, as file:line.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from typing import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfmgpu"

# Path prefix (a module without `.py`, or a package directory) -> layer, low
# to high. A module may import only from its own layer or lower; the longest
# matching prefix wins. Both `tfmgpu/x.py` and a package `tfmgpu/x/` match
# "tfmgpu/x".
LAYERS = {
    # 0 base
    "tfmgpu/__init__": 0,  # Its lazy `_EXPORTS` strings are not imports.
    "tfmgpu/_compat": 0,
    "tfmgpu/_lazy": 0,
    "tfmgpu/checks": 0,
    "tfmgpu/devices": 0,
    "tfmgpu/files": 0,
    "tfmgpu/in_graph": 0,
    "tfmgpu/ports": 0,
    "tfmgpu/rundir": 0,
    "tfmgpu/settings": 0,
    "tfmgpu/stop_notes": 0,
    "tfmgpu/tf_logs": 0,
    "tfmgpu/user_code": 0,
    # 1 registries
    "tfmgpu/data": 1,
    "tfmgpu/datasets": 1,
    "tfmgpu/models": 1,
    "tfmgpu/strategies": 1,
    # 2 engines
    "tfmgpu/parallel": 2,
    "tfmgpu/training": 2,
    # 3 services
    "tfmgpu/cluster": 3,
    "tfmgpu/diagnostics": 3,
    "tfmgpu/generation": 3,
    "tfmgpu/inference": 3,
    "tfmgpu/launcher": 3,
    "tfmgpu/placements": 3,
    # 4 runs: what a run is (config) and running it
    "tfmgpu/config": 4,
    "tfmgpu/runs": 4,
    # 5 tools
    "tfmgpu/benchmarks": 5,
    # 6 command lines
    "tfmgpu/bench": 6,
    "tfmgpu/doctor": 6,
    "tfmgpu/flags": 6,
    "tfmgpu/generate": 6,
    "tfmgpu/launch": 6,
    "tfmgpu/predict": 6,
    "tfmgpu/train": 6,
}
CLI_LAYER = 6


@dataclasses.dataclass(frozen=True)
class Import:
  """One import of a tfmgpu module, as `module` (dotted) at `line`."""
  module: str
  line: int


def _key(module: str) -> str:
  """`"tfmgpu.models.registry"` -> `"tfmgpu/models/registry"`."""
  return "tfmgpu/__init__" if module == "tfmgpu" else module.replace(".", "/")


def layer_of(module: str) -> int | None:
  """The layer of a dotted module name, or `None` if `LAYERS` lacks it."""
  key = _key(module)
  matches = [p for p in LAYERS if key == p or key.startswith(p + "/")]
  return LAYERS[max(matches, key=len)] if matches else None


def module_name(path: pathlib.Path) -> str:
  """`tfmgpu/models/__init__.py` -> `"tfmgpu.models"`."""
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _exists(module: str) -> bool:
  path = ROOT.joinpath(*module.split("."))
  return path.with_suffix(".py").is_file() or path.is_dir()


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
  """The module `from ... import` names, with relative levels resolved."""
  if not node.level:
    return node.module or ""
  parts = module.split(".")
  base = parts if is_package else parts[:-1]
  base = base[:len(base) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def _string_import(node: ast.Call) -> str | None:
  """`"tfmgpu.x"` from `LazyModule("tfmgpu.x")` or `import_module(...)`."""
  func = node.func
  name = func.attr if isinstance(func, ast.Attribute) else getattr(
      func, "id", None)
  if name not in ("LazyModule", "import_module") or not node.args:
    return None
  arg = node.args[0]
  if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
    return arg.value
  return None


def tfmgpu_imports(source: str, module: str,
                   is_package: bool = False) -> Iterator[Import]:
  """Every `tfmgpu` module that `source` (the module `module`) imports."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = _absolute(node, module, is_package)
      names = []
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        names.append((sub if _exists(sub) else base, node.lineno))
    elif isinstance(node, ast.Call):
      found = _string_import(node)
      names = [(found, node.lineno)] if found else []
    else:
      continue
    for name, line in names:
      if name == "tfmgpu" or name.startswith("tfmgpu."):
        yield Import(name, line)


def imports_absl_flags(source: str) -> Iterator[int]:
  """Lines of `source` that import `absl.flags` (any form, any depth)."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      if any(a.name == "absl.flags" or a.name.startswith("absl.flags.")
             for a in node.names):
        yield node.lineno
    elif isinstance(node, ast.ImportFrom) and not node.level:
      if node.module == "absl" and any(a.name == "flags" for a in node.names):
        yield node.lineno
      elif (node.module or "").startswith("absl.flags"):
        yield node.lineno


def _modules() -> list[tuple[pathlib.Path, str]]:
  return [(path, module_name(path))
          for path in sorted(PACKAGE.rglob("*.py"))]


def _where(path: pathlib.Path, line: int | None = None) -> str:
  rel = path.relative_to(ROOT).as_posix()
  return rel if line is None else f"{rel}:{line}"


def test_every_module_has_a_layer():
  missing = [_where(path) for path, module in _modules()
             if layer_of(module) is None]
  if missing:
    pytest.fail("Modules without a layer; add them to LAYERS in "
                "tests/test_layers.py:\n  " + "\n  ".join(missing))


def test_no_module_imports_from_a_higher_layer():
  violations = []
  for path, module in _modules():
    own = layer_of(module)
    if own is None:
      continue  # Reported by test_every_module_has_a_layer.
    for imp in tfmgpu_imports(path.read_text(), module,
                              path.name == "__init__.py"):
      target = layer_of(imp.module)
      if target is None:
        violations.append(f"{_where(path, imp.line)}: {module} (layer "
                          f"{own}) imports {imp.module}, which has no layer")
      elif target > own:
        violations.append(f"{_where(path, imp.line)}: {module} (layer "
                          f"{own}) imports {imp.module} (layer {target})")
  if violations:
    pytest.fail(f"{len(violations)} import(s) from a higher layer:\n  " +
                "\n  ".join(violations))


def test_only_command_lines_import_absl_flags():
  violations = [
      f"{_where(path, line)}: {module} (layer {layer_of(module)}) imports "
      "absl.flags; library modules take arguments, the CLI reads flags"
      for path, module in _modules() if layer_of(module) != CLI_LAYER
      for line in imports_absl_flags(path.read_text())]
  if violations:
    pytest.fail("absl.flags outside the CLIs:\n  " + "\n  ".join(violations))


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The circles of an import graph `{module: modules it imports}`: each
  strongly connected set of two or more modules, sorted (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  circles = []

  def visit(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    for target in graph.get(node, ()):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      members = []
      while not members or members[-1] != node:
        members.append(stack.pop())
      if len(members) > 1:
        circles.append(sorted(members))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return sorted(circles)


def test_no_import_circle():
  graph = {module: {i.module for i in tfmgpu_imports(
      path.read_text(), module, path.name == "__init__.py")} - {module}
           for path, module in _modules()}
  circles = import_circles(graph)
  if circles:
    pytest.fail("Modules that import each other (directly or through "
                "others; move what both need into a module below them):\n  "
                + "\n  ".join(" <-> ".join(c) for c in circles))


def test_the_circle_finder_finds_circles_only():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(),
           "f": {"f"}}
  assert import_circles(graph) == [["a", "b", "c"]]
  assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_parallel_package_lists_its_modules_low_to_high():
  init = PACKAGE / "parallel" / "__init__.py"
  listed = re.findall(r"^\* `(\w+)`:", ast.get_docstring(
      ast.parse(init.read_text())), re.MULTILINE)
  modules = sorted(p.stem for p in init.parent.glob("*.py")
                   if p.stem != "__init__")
  assert sorted(listed) == modules, "list every module in its docstring"
  later = []
  for position, name in enumerate(listed):
    module = f"tfmgpu.parallel.{name}"
    source = (init.parent / f"{name}.py").read_text()
    later += [f"{name} imports {i.module}" for i in tfmgpu_imports(
        source, module) if i.module.startswith("tfmgpu.parallel.")
              and i.module.split(".")[2] in listed[position:]]
  assert not later, ("tfmgpu/parallel/__init__.py lists these modules after "
                     "one that imports them: " + "; ".join(later))


def test_the_checker_sees_every_kind_of_import():
  source = '''
import tfmgpu.devices
from tfmgpu import config
from tfmgpu.training import loop
from . import cluster
from absl import flags
from absl.flags import FLAGS
tf = LazyModule("tensorflow")
runs = LazyModule("tfmgpu.runs")

def later():
  from tfmgpu import inference
  import absl.flags
  return importlib.import_module("tfmgpu.launcher")
'''
  found = [(i.module, i.line)
           for i in tfmgpu_imports(source, "tfmgpu.diagnostics.probe")]
  assert sorted(found) == [
      ("tfmgpu.config", 3), ("tfmgpu.devices", 2),
      ("tfmgpu.diagnostics", 5),  # `from . import cluster`: no such module.
      ("tfmgpu.inference", 12), ("tfmgpu.launcher", 14), ("tfmgpu.runs", 9),
      ("tfmgpu.training.loop", 4)]
  assert sorted(imports_absl_flags(source)) == [6, 7, 13]
  assert layer_of("tfmgpu") == 0
  assert layer_of("tfmgpu.models.registry") == 1
  assert layer_of("tfmgpu.datasets.tfrecord") == 1
  assert layer_of("tfmgpu.launcher") == 3
  assert layer_of("tfmgpu.launch") == 6
  assert layer_of("tfmgpu.unknown_module") is None


# The rooms the Trainer (`training/loop.py`) is a thin front over: its
# settings, input plan, executions (runner and evaluator pairs), runners,
# evaluator and controller. None imports the front.
TRAINER_ROOMS = ("batches", "controller", "coordinator", "evaluation",
                 "execution", "feeds", "inputs", "model_checks", "runners",
                 "trainer_options")


def test_the_trainer_is_a_front_over_its_rooms():
  training = PACKAGE / "training"
  fronts = {"tfmgpu.training.loop", "tfmgpu.training.parameter_server"}
  upward = []
  for name in TRAINER_ROOMS:
    path = training / f"{name}.py"
    upward += [f"{_where(path, i.line)}: imports {i.module}"
               for i in tfmgpu_imports(path.read_text(),
                                       f"tfmgpu.training.{name}")
               if i.module in fronts]
  assert not upward, "\n".join(upward)
  # The front asks no object what kind it is: the execution is chosen once,
  # by name, and the model's kind is `step.brings_own_backward`'s question.
  tree = ast.parse((training / "loop.py").read_text())
  asked = sorted({n.func.id for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("isinstance", "getattr", "hasattr")})
  assert not asked, f"training/loop.py calls {asked}"


def test_every_parallel_module_is_reachable_as_an_attribute():
  """`tfmgpu.parallel.X` works for every module X, imported or not (the
  lazy `_SUBMODULES` list missed 7 after a session of new modules)."""
  import tfmgpu.parallel  # pylint: disable=g-import-not-at-top
  modules = {p.stem for p in (PACKAGE / "parallel").glob("*.py")
             if p.stem != "__init__"}
  assert modules == set(tfmgpu.parallel._SUBMODULES)  # pylint: disable=protected-access
