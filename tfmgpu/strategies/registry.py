"""The registry of distributions: every strategy and placement, by name.

A *distribution* is one way tfmgpu spreads work over devices, as one object:
its name and one-line description, a typed options dataclass, the rules it
adds to a run's config, how it builds a model for training (`place`), how it
serves loaded models (`serve`) and how it describes its layout in a run's
summary (`describe`). Data-parallel distributions (`Kind.DATA_PARALLEL`)
build a genuine `tf.distribute.Strategy`; placements (`Kind.PLACEMENT`:
model, pipeline, branch and tensor parallelism and their hybrid layouts)
split the model itself and run under the default strategy, and `auto`
hands over to whichever of the others the cost model picks, data
parallelism included.

Each distribution is registered by the module that implements it
(`@register`). The built-in ones live in `tfmgpu.strategies.data_parallel`
and the `tfmgpu.placements` package; they are discovered on the first
lookup or registration (`BUILTIN_PROVIDERS`, so they keep their order), the
one place this layer names modules above it, as a plugin list, without
importing them at import time.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, ClassVar

from tfmgpu import checks
from tfmgpu import files
from tfmgpu import settings
from tfmgpu._lazy import LazyModule

tf = LazyModule("tensorflow")

# Modules whose import registers the built-in distributions.
BUILTIN_PROVIDERS = ("tfmgpu.strategies.data_parallel", "tfmgpu.placements")


class Kind(str, enum.Enum):
  """How a registered name spreads work."""
  DATA_PARALLEL = "data_parallel"    # Replicas of the whole model.
  PLACEMENT = "placement"            # The model itself is split over devices.


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """Options of a distribution that takes none."""


@dataclasses.dataclass(frozen=True)
class RunFacts:
  """The settings of a run that a distribution's cross-field rules
  (`Distribution.check_config`) read besides its own options.

  Attributes:
    global_batch_size: examples per step over all replicas.
    virtual_devices: logical devices the accelerator is split into
      (`None`: left alone).
    model: the model's registered name or `module:function` reference.
    model_size: its named size, if it has sizes.
  """
  global_batch_size: int
  virtual_devices: int | None = None
  model: str = ""
  model_size: str | None = None


@dataclasses.dataclass
class Placement:
  """Where a run's model lives: its strategy, devices and the built model.

  Attributes:
    strategy: the `tf.distribute.Strategy` training runs under.
    devices: short device names (replicas, stages or branches).
    model: the built (possibly split) model.
    plan: the stage plan of a split model, else `None`.
    distribution: the distribution that placed it.
    options: that distribution's options.
    costs: what the cost model needs to predict the step of a placed
      layout (`tfmgpu.parallel.accounting.LayoutCosts`), else `None`.
  """
  strategy: Any
  devices: list[str]
  model: Any
  plan: Any = None
  distribution: "Distribution | None" = None
  options: Any = None
  costs: Any = None


class Distribution:
  """One strategy or placement. Subclass, set the class attributes, register.

  Attributes:
    name: the registry key (`--strategy` value).
    description: one line for help text and docs.
    kind: `Kind.DATA_PARALLEL` or `Kind.PLACEMENT`.
    needs: what it needs to run, for the docs' strategy table.
    Options: a frozen dataclass of its options (validated in
      `__post_init__`); each field is also a `TrainConfig` field, so every
      option is reachable from Python and the CLI.
    joins_cluster: it reads a cluster (TF_CONFIG or SLURM) and must be
      created before TensorFlow's runtime starts in the process.
    concurrent_devices: its devices compute at the same time (replicas,
      pipeline stages, branches), so a CPU split into logical devices gives
      each op only its share of the cores (`devices.configure_devices`).
    layout: what its devices hold, for summaries: replicas, stages, branches.
    cluster_jobs: the TF_CONFIG jobs a cluster of it may hold (joining
      strategies only).
    required_jobs: the jobs it cannot run without; their absence (or no
      TF_CONFIG at all) is an error before TensorFlow loads.
    slurm: a SLURM job can describe its cluster (every task the same role).
    job_roles: what a job does, where messages should say it.
    python_api: a placement's own Python class (`tfmgpu.PipelinedModel`),
      named when `get_strategy` is asked for the placement.
    keras_fit_caveat: what goes wrong when Keras' own `fit`/`evaluate`
      run under its strategy; `get_strategy` warns with it (a reused
      strategy meets Keras' loop, tfmgpu's runs use the `Trainer`).
    execution: how a `Trainer` runs its steps under it
      (`tfmgpu.training.loop.EXECUTIONS`): `"sync"` (`strategy.run`), or
      `"coordinator"` (steps scheduled on a parameter-server cluster's
      workers).
  """
  name: ClassVar[str] = ""
  description: ClassVar[str] = ""
  kind: ClassVar[Kind] = Kind.DATA_PARALLEL
  needs: ClassVar[str] = ""
  Options: ClassVar[type] = NoOptions
  joins_cluster: ClassVar[bool] = False
  concurrent_devices: ClassVar[bool] = True
  layout: ClassVar[str] = "replicas"
  cluster_jobs: ClassVar[tuple[str, ...]] = ()
  required_jobs: ClassVar[tuple[str, ...]] = ()
  slurm: ClassVar[bool] = True
  job_roles: ClassVar[dict[str, str]] = {}
  python_api: ClassVar[str] = ""
  keras_fit_caveat: ClassVar[str] = ""
  execution: ClassVar[str] = "sync"

  # ------------------------------------------------------------ options

  def options(self, **values: Any) -> Any:
    """This distribution's validated `Options` from keyword arguments.

    Raises:
      ValueError: an option it does not take (listing the ones it does), or
        a value its `Options` rejects.
    """
    fields = [f.name for f in dataclasses.fields(self.Options)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
      raise ValueError(
          f"strategy {self.name!r} got an unknown option "
          f"({', '.join(unknown)}). Its options: {', '.join(fields) or 'none'}.")
    return self.Options(**values)

  def options_from(self, source: Any) -> Any:
    """`Options` read from an object with same-named attributes (parsed
    flags); attributes it lacks or sets to `None` keep their defaults."""
    return self.options_of({f.name: getattr(source, f.name, None)
                            for f in dataclasses.fields(self.Options)})

  def options_of(self, values: Mapping[str, Any]) -> Any:
    """`Options` from a run's setting values by name (a config's
    `values_of(Options)`); names it does not take, and `None`, keep their
    defaults."""
    return self.Options(**{f.name: values[f.name]
                           for f in dataclasses.fields(self.Options)
                           if values.get(f.name) is not None})

  def check_config(self, options: Any, run: RunFacts) -> None:
    """Cross-field rules between this distribution's `options` and the
    rest of a run's settings (`run`).

    Raises:
      ValueError: a rule broken, naming the settings and the fix.
    """
    del options, run

  def in_graph(self, options: Any) -> bool:
    """Whether one task (the chief) drives every task's devices and the
    others only serve them (`tfmgpu.in_graph`)."""
    del options
    return False

  @property
  def intra_op_threads(self) -> int | None:
    """For `devices.configure_devices`: `None` shares the cores between
    devices that compute at once; `0` leaves TensorFlow's setting."""
    return None if self.concurrent_devices else 0

  # ------------------------------------------------- training and serving

  def make_strategy(self, options: Any) -> "tf.distribute.Strategy":
    """The `tf.distribute.Strategy` to run under (placements: the default)."""
    del options
    return tf.distribute.get_strategy()

  def place(self, options: Any, build: Callable[[], Any], *,
            strategy: Any = None, seed: int = 0) -> Placement:
    """Builds the model for training where this distribution puts it."""
    raise NotImplementedError

  def serve(self, models: Sequence[Any], options: Any) -> tuple[Any, Any]:
    """Places loaded models for inference; returns `(model, strategy)`,
    `strategy` `None` when the model places itself."""
    raise NotImplementedError

  def layout_of(self, options: Any) -> Any:
    """The `tfmgpu.parallel.hybrid.Layout` that `options` ask for (`None`:
    no data x stages x tensor layout; whole copies of the model)."""
    del options
    return None

  def micro_batches(self, options: Any) -> int | None:
    """Micro-batches each global batch is split into (`None`: not split)."""
    del options
    return None

  def save_model(self, model: Any, path: str) -> str:
    """Saves the trained `model` servable; returns what `--model_path`
    takes. The file is written aside and renamed into place, so an
    existing one is replaced whole or not at all."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return files.save_keras_model(model, path)

  # ------------------------------------------------------------- reports

  def replicas(self, placement: Placement) -> int:
    """How many data-parallel replicas `placement` trains (the summary's
    count): its strategy's."""
    return placement.strategy.num_replicas_in_sync

  def describe(self, placement: Placement) -> list[tuple[str, str]]:
    """Rows for a run's summary: what the devices hold."""
    devices = ", ".join(placement.devices)
    count = (placement.strategy.num_replicas_in_sync
             if self.layout == "replicas" else len(placement.devices))
    return [(self.layout, f"{count} on {devices}")]

  def record(self, options: Any) -> dict[str, Any]:
    """What `run.json` records of this distribution: `placement` (what
    shapes the checkpoints: `data_parallel` for any data-parallel strategy
    and replica count, else the name and the options declared with
    `record=`), `micro_batches` (they decide the batch arithmetic) and
    `portable` (`portable`)."""
    if self.kind is not Kind.PLACEMENT:
      return {"placement": "data_parallel", "micro_batches": None,
              "portable": self.portable(options)}
    shape = ", ".join(f"{k}={v}" for k, v in settings.recorded(options))
    return {"placement": f"{self.name} ({shape})" if shape else self.name,
            "micro_batches": self.micro_batches(options),
            "portable": self.portable(options)}

  def portable(self, options: Any) -> bool:
    """Whether the checkpoints of a run under `options` carry the weights
    by layer name (`tfmgpu.training.portable`: the model places itself), so
    that a resume may move them into another layout that does too."""
    del options
    return self.kind is Kind.PLACEMENT

  def plan_text(self, model: Any, options: Any, *, global_batch_size: int,
                optimizer: str, input_shape: Any = None) -> str | None:
    """What `--plan_only` prints for `model` (built with weight shapes
    only); `None`: no plan of its own (a run prints the stage plan its
    stage options ask for)."""
    del model, options, global_batch_size, optimizer, input_shape
    return None

  def __repr__(self) -> str:
    return f"<{type(self).__name__} {self.name!r} ({self.kind.value})>"


_REGISTRY: dict[str, Distribution] = {}
_DISCOVERED = False


def register(cls: type[Distribution]) -> type[Distribution]:
  """Class decorator: registers one instance of `cls` under `cls.name`.

  Raises:
    ValueError: no name, or the name is taken.
  """
  _discover()  # Built-ins first, so names keep their documented order.
  if not cls.name:
    raise ValueError(f"{cls.__name__} has no `name`; set the class attribute.")
  if cls.name in _REGISTRY:
    raise ValueError(f"strategy name {cls.name!r} is already registered "
                     f"({_REGISTRY[cls.name]!r}).")
  _REGISTRY[cls.name] = cls()
  return cls


def unregister(name: str) -> None:
  """Removes a registered name (tests and plugins that clean up)."""
  _REGISTRY.pop(name, None)


def _discover() -> None:
  global _DISCOVERED
  if not _DISCOVERED:
    _DISCOVERED = True
    for module in BUILTIN_PROVIDERS:
      importlib.import_module(module)


def lookup(name: str) -> Distribution:
  """The distribution registered under `name` (case-insensitive).

  Raises:
    ValueError: unknown name, listing the available ones.
  """
  _discover()
  key = name.lower() if isinstance(name, str) else name
  if key not in _REGISTRY:
    raise ValueError(
        f"Unknown strategy name={name!r}.{checks.did_you_mean(key, _REGISTRY)}"
        f" Available names: {', '.join(sorted(_REGISTRY))}.")
  return _REGISTRY[key]


def registered() -> dict[str, Distribution]:
  """Every registered distribution, by name, in registration order."""
  _discover()
  return dict(_REGISTRY)


def available_strategies() -> dict[str, str]:
  """Returns `{name: one-line description}` for every registered name."""
  return {n: d.description for n, d in registered().items()}
