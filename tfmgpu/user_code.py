"""The user's own functions, named as `module:function` where a name goes.

`--model`, `--dataset`, `--loss` and `--metrics` take a registered name or a
reference to the user's code, in one of two forms:

* `package.module:function`: a module importable from the Python path
  (the current directory, `PYTHONPATH`, installed packages);
* `path/to/file.py:function`: a Python file, imported on its own (its
  directory is appended to `sys.path`, so it can import its neighbours).

`function` may be dotted (`module:Class.method`). A reference is checked in
two steps, so that mistakes are said early:

1. `check_reference` (no import, before TensorFlow loads): the form; that
   the module is found (`importlib.util.find_spec`, which imports only its
   parent packages) or the file exists; and, reading the module's source,
   that it defines the name and, for a plain `def`, that the function
   accepts the call it will get.
2. `load_function` (imports the module, which may import TensorFlow): the
   attribute exists, is callable and accepts the call (`inspect.signature`).

Errors are `UserCodeError` (a `ValueError`) naming the setting and echoing
the value. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Iterable
from typing import Any, Callable

from tfmgpu import checks

FORMS = "'package.module:function' or 'path/to/file.py:function'"

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class UserCodeError(ValueError):
  """A reference to the user's code that cannot be used, and why."""


@dataclasses.dataclass(frozen=True)
class Call:
  """How a referenced function will be called, to check its signature.

  Attributes:
    args: example positional arguments (values do not matter).
    options: keyword arguments passed only if the function names them (or
      takes `**kwargs`).
    shown: the expected signature, for messages, e.g.
      `"build(input_shape, num_classes)"`.
  """
  args: tuple[Any, ...] = ()
  options: tuple[str, ...] = ()
  shown: str = ""


@dataclasses.dataclass(frozen=True)
class Reference:
  """A parsed `module:function` reference."""
  module: str
  attribute: str

  @property
  def is_file(self) -> bool:
    """Names a `.py` file (or a path), not a dotted module."""
    return self.module.endswith(".py") or "/" in self.module or (
        os.sep in self.module)


def is_reference(value: Any) -> bool:
  """A string naming user code (`a:b`), not a registry name."""
  return isinstance(value, str) and ":" in value


def parse_reference(what: str, value: str) -> Reference:
  """Splits `value` at its last colon and checks the form of both parts.

  Raises:
    UserCodeError: not `module:function` (or `file.py:function`).
  """
  module, _, attribute = value.rpartition(":")
  ref = Reference(module.strip(), attribute.strip())
  if not ref.module or not _DOTTED.match(ref.attribute) or (
      not ref.is_file and not _DOTTED.match(ref.module)):
    raise UserCodeError(
        f"{what}={value!r} is not a reference to your code: use {FORMS} "
        "(a module on the Python path, or a file, then ':' and the name of "
        "a function in it).")
  return ref


def resolvable(value: Any) -> Any:
  """`value` with a file reference's path made absolute
  (`path/to/file.py:fn` -> `/cwd/path/to/file.py:fn`), so that it names the
  same file from any directory (`run.json`); anything else unchanged."""
  if not is_reference(value):
    return value
  module, _, attribute = value.rpartition(":")
  if not Reference(module.strip(), attribute.strip()).is_file:
    return value
  return f"{os.path.abspath(module.strip())}:{attribute.strip()}"


def check_reference(what: str, value: str, call: Call | None = None
                    ) -> Reference:
  """Checks `value` without importing it (before TensorFlow loads).

  Args:
    what: the setting, for messages (`"model"`: also the flag `--model`).
    value: the reference.
    call: how the function will be called; its signature is checked when
      the source shows a plain `def`.

  Raises:
    UserCodeError: a bad form, a module or file not found, a name the
      module does not define, or a `def` that does not accept `call`.
  """
  ref = parse_reference(what, value)
  source_path = _source_path(what, value, ref)
  if source_path is None:
    return ref
  try:
    with open(source_path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), filename=source_path)
  except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
    raise UserCodeError(f"{what}={value!r}: {source_path} cannot be read as "
                        f"Python ({type(e).__name__}: {e}).") from e
  _check_source(what, value, ref, tree, source_path, call)
  return ref


def check_name(what: str, value: str, registered: Iterable[str],
               call: Call | None = None) -> None:
  """A registered name, or a usable reference (`check_reference`).

  Args:
    what: the setting (`"model"`, `"dataset"`): errors say `what=value`.
    value: the name or reference given.
    registered: the names the registry holds.
    call: how the referenced function will be called.

  Raises:
    ValueError: an unknown name (listing the registered ones), or a
      reference that cannot be used (`UserCodeError`).
  """
  if is_reference(value):
    check_reference(what, value, call)
    return
  registered = list(registered)
  if value not in registered:
    builder = "builder" if what == "model" else "loader"
    hint = checks.did_you_mean(value, registered)
    raise ValueError(f"{what}={value!r} is unknown.{hint} Choose one of "
                     f"{', '.join(registered)}, or name your own {builder} as "
                     f"{FORMS}.")


def _source_path(what: str, value: str, ref: Reference) -> str | None:
  """The `.py` file that `ref` names (`None`: not plain source)."""
  if ref.is_file:
    if not os.path.isfile(ref.module):
      raise UserCodeError(
          f"{what}={value!r}: the file {ref.module!r} does not exist (from "
          f"{os.getcwd()}). Give a path to a .py file, relative to the "
          "current directory or absolute.")
    return ref.module
  try:
    spec = importlib.util.find_spec(ref.module)
  except Exception as e:  # pylint: disable=broad-except  (a parent failed)
    raise UserCodeError(
        f"{what}={value!r}: module {ref.module!r} cannot be found "
        f"({type(e).__name__}: {e}). {_path_hint(ref)}") from e
  if spec is None:
    raise UserCodeError(
        f"{what}={value!r}: no module named {ref.module!r} on the Python "
        f"path. {_path_hint(ref)}")
  origin = spec.origin or ""
  return origin if origin.endswith(".py") else None


def _path_hint(ref: Reference) -> str:
  return ("Run from the directory that holds it, add its directory to "
          "PYTHONPATH (e.g. PYTHONPATH=scripts/examples), or give the file: "
          f"'path/to/{ref.module.rsplit('.', 1)[-1]}.py:{ref.attribute}'.")


def _top_level(tree: ast.Module) -> tuple[dict[str, ast.AST], bool]:
  """The module's top-level names -> their last defining statement, and
  whether names can come from elsewhere (`import *`, `__getattr__`)."""
  names: dict[str, ast.AST] = {}
  open_ended = False
  body = list(tree.body)
  while body:
    node = body.pop(0)
    if isinstance(node, (ast.If, ast.Try, ast.With)):
      for part in ("body", "orelse", "finalbody"):
        body.extend(getattr(node, part, []))
      for handler in getattr(node, "handlers", []):
        body.extend(handler.body)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
      names[node.name] = node
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      for alias in node.names:
        open_ended |= alias.name == "*"
        names[(alias.asname or alias.name).split(".")[0]] = node
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for target in targets:
        for leaf in ast.walk(target):
          if isinstance(leaf, ast.Name) and isinstance(leaf.ctx, ast.Store):
            names[leaf.id] = node
  return names, open_ended or "__getattr__" in names


def _check_source(what: str, value: str, ref: Reference, tree: ast.Module,
                  path: str, call: Call | None) -> None:
  names, open_ended = _top_level(tree)
  first = ref.attribute.split(".")[0]
  if first not in names:
    if open_ended:
      return  # Defined by `import *` or `__getattr__`: the import will tell.
    functions = sorted(n for n, node in names.items()
                       if isinstance(node, (ast.FunctionDef,
                                            ast.AsyncFunctionDef))
                       and not n.startswith("_"))
    raise UserCodeError(
        f"{what}={value!r}: {path} defines no {first!r}. Its functions: "
        f"{', '.join(functions) or 'none'}.")
  node = names[first]
  if (call is not None and ref.attribute == first
      and isinstance(node, ast.FunctionDef) and not node.decorator_list):
    _check_call(what, value, first, _signature_of(node.args), call)


class _SourceDefault:
  """A default value seen in source, not evaluated: shown as `...`."""

  def __repr__(self) -> str:
    return "..."


def _signature_of(args: ast.arguments) -> inspect.Signature:
  """The signature a `def` with these arguments has (defaults as `...`)."""
  p = inspect.Parameter
  default = _SourceDefault()
  positional = [(a, p.POSITIONAL_ONLY) for a in args.posonlyargs] + [
      (a, p.POSITIONAL_OR_KEYWORD) for a in args.args]
  first_default = len(positional) - len(args.defaults)
  params = [p(a.arg, kind, default=default if i >= first_default else p.empty)
            for i, (a, kind) in enumerate(positional)]
  if args.vararg:
    params.append(p(args.vararg.arg, p.VAR_POSITIONAL))
  params += [p(a.arg, p.KEYWORD_ONLY,
               default=p.empty if d is None else default)
             for a, d in zip(args.kwonlyargs, args.kw_defaults)]
  if args.kwarg:
    params.append(p(args.kwarg.arg, p.VAR_KEYWORD))
  return inspect.Signature(params)


def accepted_options(signature: inspect.Signature,
                     options: tuple[str, ...]) -> tuple[str, ...]:
  """Those of `options` a function with `signature` takes by keyword."""
  params = signature.parameters.values()
  if any(q.kind is q.VAR_KEYWORD for q in params):
    return tuple(options)
  named = {q.name for q in params
           if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)}
  return tuple(o for o in options if o in named)


def keyword_options(fn: Callable[..., Any],
                    options: tuple[str, ...]) -> tuple[str, ...]:
  """Those of `options` that `fn` takes (all, if its signature is unknown)."""
  try:
    return accepted_options(inspect.signature(fn), options)
  except (TypeError, ValueError):
    return tuple(options)


def _check_call(what: str, value: str, name: str,
                signature: inspect.Signature, call: Call) -> None:
  options = {o: None for o in accepted_options(signature, call.options)}
  try:
    signature.bind(*call.args, **options)
  except TypeError as e:
    raise UserCodeError(
        f"{what}={value!r}: {name}{signature} cannot be called as "
        f"{call.shown} ({e}). Define it as `def {call.shown}:` (extra "
        "arguments need defaults).") from None


def load_function(what: str, value: str, call: Call | None = None
                  ) -> Callable[..., Any]:
  """Imports the function `value` names and checks it accepts `call`.

  Raises:
    UserCodeError: as `check_reference`, or the import fails, or the name
      is missing, not callable, or its signature does not accept `call`.
  """
  ref = check_reference(what, value, call)
  module = _import(what, value, ref)
  obj: Any = module
  for part in ref.attribute.split("."):
    if not hasattr(obj, part):
      raise UserCodeError(f"{what}={value!r}: {ref.module!r} has no "
                          f"attribute {part!r}.")
    obj = getattr(obj, part)
  if not callable(obj):
    raise UserCodeError(
        f"{what}={value!r} names an object of type {type(obj).__name__}, "
        "not a function. "
        f"Name a function{f': {call.shown}' if call else ''}.")
  if call is not None:
    try:
      signature = inspect.signature(obj)
    except (TypeError, ValueError):  # A builtin without one: call and see.
      return obj
    _check_call(what, value, ref.attribute, signature, call)
  return obj


def _import(what: str, value: str, ref: Reference) -> Any:
  try:
    if ref.is_file:
      module = _import_file(os.path.abspath(ref.module))
    else:
      module = importlib.import_module(ref.module)
  except Exception as e:  # pylint: disable=broad-except  (the user's code)
    raise UserCodeError(f"{what}={value!r}: importing {ref.module!r} failed: "
                        f"{type(e).__name__}: {e}") from e
  if getattr(module, "__file__", None):
    _USER_FILES.add(os.path.abspath(module.__file__))
  return module


# The files of the modules `load_function` imported: where an error left
# the user's code is the innermost frame in one of them (`raised_at`).
_USER_FILES: set[str] = set()


def raised_at(error: BaseException) -> str | None:
  """`path:line in function` of the innermost frame of `error` (or of the
  error it was raised from) in the user's code that `load_function`
  imported; `None` when it was not raised there."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    where = None
    for frame, line in traceback.walk_tb(error.__traceback__):
      path = os.path.abspath(frame.f_code.co_filename)
      if path in _USER_FILES:
        where = f"{path}:{line} in {frame.f_code.co_name}"
    if where:
      return where
    error = error.__cause__ or error.__context__
  return None


# How AutoGraph begins the message of an error raised while tracing a
# `tf.function`: the traced frames, then the error it re-raises.
_TRACED = "in user code:"
_TRACED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _traced_origin(error: BaseException) -> tuple[BaseException, str | None]:
  """For AutoGraph's re-raise of an error from a traced function: the
  error it re-raised (its `__context__`) and the innermost traced frame in
  the user's code (`path:line in function`); else `(error, None)`."""
  if not str(error).startswith(_TRACED):
    return error, None
  where = None
  for path, line, function in _TRACED_FRAME.findall(str(error)):
    if os.path.abspath(path) in _USER_FILES:
      where = f"{os.path.abspath(path)}:{line} in {function}"
  origin = error
  while (origin.__context__ is not None
         and str(origin).startswith(_TRACED)):
    origin = origin.__context__
  return origin, where


def describe_error(error: BaseException) -> str:
  """`str(error)`, with where it left the user's code when it was raised
  there (a CLI prints only the message: `error: bad row` named no file).
  An error from a traced step is said by the error AutoGraph re-raised
  (its message began with a page of TF's and tfmgpu's frames)."""
  origin, where = _traced_origin(error)
  where = where or raised_at(error)
  return f"{origin} (raised at {where})" if where else str(origin)


_FILE_MODULES: dict[str, Any] = {}


def _import_file(path: str) -> Any:
  """The module of the file at `path`, executed once per process."""
  if path in _FILE_MODULES:
    return _FILE_MODULES[path]
  stem = os.path.splitext(os.path.basename(path))[0]
  name = stem
  if not stem.isidentifier() or stem in sys.modules:  # Keep both modules.
    digest = hashlib.sha256(path.encode()).hexdigest()[:8]
    name = f"_user_{digest}_" + re.sub(r"\W", "_", stem)
  directory = os.path.dirname(path)
  if directory not in sys.path:
    sys.path.append(directory)  # Its neighbours import, as for a script.
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # Before running it: dataclasses look it up.
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  _FILE_MODULES[path] = module
  return module
