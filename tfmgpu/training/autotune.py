"""Autotune: the training options that are fastest on this machine, measured.

What is fastest differs by machine: XLA per replica helps on one CPU and
costs on another, and so does 16-bit gradient compression. `tune` times
short runs of the few options that matter (`TUNED`: where batches come
from, steps per `tf.function` call, XLA per replica, gradient compression,
batch splits), each changed alone from the current settings, interleaved
over a few rounds (each candidate's best round kept). The winners, alone
and together, are then measured again in paired rounds, each beside the
current settings: a change is kept only when it is faster than the current
settings by `margin` in the first rounds *and in the paired rounds' median,
and slower in none of them* (`Paired`), so a lucky round never replaces a
default (the machine's own drift moves one round by 20% here), while one
unlucky round does not hide a real gain. When something was picked, each option it
left alone is then tried on top of the pick, in paired rounds beside it
(batch splits pay on gpt only under XLA). Nothing is chosen by the CPU's
name: the name only keys the cache.

The choice is cached in `cache_path()` (`autotune.json` in the tfmgpu cache
directory, `tfmgpu.data.cache_dir`), keyed by the CPU model, core count,
threads per op, TensorFlow version, tfmgpu's own code (`code_version`: a
digest of the package's source files, so two checkouts, or one checkout
before and after an edit, never share a choice), the model's signature,
the global batch, the strategy, its replica count and the settings tuning
started from; a second call with the same key measures nothing.

`tune(measure, ...)` takes any `measure(settings) -> ms per step`;
`TrainerTimer` is the real one (short `Trainer.fit` runs that reuse each
candidate's compiled step across rounds) and `tune_training` puts the two
together for a model builder and a strategy.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable

from absl import logging

from tfmgpu import data as data_lib
from tfmgpu import devices as devices_lib
from tfmgpu import files

# The options `tune` may change, in the order it reports them.
TUNED = ("input_mode", "steps_per_execution", "jit_compile",
         "gradient_compression", "batch_splits")
CACHE_FILE = "autotune.json"
# 2: a pick must win every paired round (format 1 compared best rounds, and
# kept a few lucky picks); entries of another format are measured again.
_CACHE_FORMAT = 2


@dataclasses.dataclass(frozen=True)
class Settings:
  """The options the autotune chooses; `Trainer` arguments of the same names.

  The defaults are tfmgpu's (those of `TrainConfig` and the bench).
  """
  input_mode: str = "auto"
  steps_per_execution: int = 10
  jit_compile: bool = False
  gradient_compression: str = "none"
  batch_splits: int = 1

  def changes(self, other: "Settings") -> dict[str, Any]:
    """The fields where `other` differs from `self`, with `other`'s values."""
    return {name: getattr(other, name) for name in TUNED
            if getattr(other, name) != getattr(self, name)}

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def changes_label(changes: Mapping[str, Any]) -> str:
  """How `Choice.times_ms` names a candidate: `"current"` (no change), or
  its changes as `"steps_per_execution=20 + jit_compile=True"`."""
  if not changes:
    return "current"
  return " + ".join(f"{k}={v}" for k, v in changes.items())


@dataclasses.dataclass(frozen=True)
class Choice:
  """What `tune` picked, from what, and why.

  Attributes:
    settings: the options to train with.
    current: the settings tuning started from (returned unchanged when
      tuning is off).
    times_ms: ms per optimizer step of each candidate, by label
      (`"current"`, `"jit_compile=True"`, ...), best round kept.
    reason: one sentence: what was faster or slower, by how much.
    source: `"measured"`, `"cache"` (measured by an earlier call) or
      `"off"` (nothing measured).
  """
  settings: Settings
  current: Settings
  times_ms: dict[str, float]
  reason: str
  source: str

  @property
  def picked(self) -> dict[str, Any]:
    """The options that differ from `current`."""
    return self.current.changes(self.settings)

  def describe(self) -> str:
    """One line for a run's log: the options picked and why."""
    picked = changes_label(self.picked)
    what = "kept the current settings" if picked == "current" else (
        f"picked {picked}")
    return f"autotune ({self.source}): {what}. {self.reason}"


def search_space(current: Settings, *, replicas: int,
                 max_steps_per_execution: int | None = None,
                 splittable: bool = False) -> dict[str, tuple]:
  """The values `tune` tries for each option (the current one included).

  Args:
    current: the settings tuning starts from.
    replicas: compression is only tried with more than one replica.
    max_steps_per_execution: no more steps per call than this (one epoch).
    splittable: the model trains exactly in batch splits
      (`batch_splits.problem` is `None`) and each replica has 2 rows or
      more: 2 splits are tried.
  """
  spe = current.steps_per_execution
  spe_values = sorted({v for v in (spe, 2 * spe, 4 * spe)
                       if v == spe or max_steps_per_execution is None
                       or v <= max_steps_per_execution})
  space: dict[str, tuple] = {
      # `auto` holds small data on the devices: `tf_data` is the other way.
      "input_mode": ((current.input_mode, "device")
                     if current.input_mode == "tf_data"
                     else (current.input_mode, "tf_data")),
      "steps_per_execution": tuple(spe_values),
      "jit_compile": (False, True),
  }
  if replicas > 1:
    space["gradient_compression"] = ("none", "float16")
  if splittable:
    space["batch_splits"] = tuple(sorted({current.batch_splits, 2}))
  return space


# ---------------------------------------------------------------- the key

def cpu_model() -> str:
  """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown CPU"


def model_signature(model: Any) -> str:
  """A digest of the model's shape: its class, layers and weight shapes."""
  parts = [type(model).__name__, str(getattr(model, "input_shape", None))]
  for layer in getattr(model, "layers", []):
    parts.append(type(layer).__name__)
    parts.extend(f"{tuple(w.shape)}:{w.dtype}" for w in layer.weights)
  digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
  return f"{getattr(model, 'name', 'model')}-{digest}"


# What of the package `code_version` leaves out (top-level entries): the
# bench's harness (what it times and prints, and its CLI) does not change
# what a training step does, so editing it keeps the measured choices (a
# full bench measures them again only when the code that trains changed).
_HARNESS = ("benchmarks", "bench.py")


@functools.lru_cache(maxsize=None)
def code_version(package_dir: str | None = None) -> str:
  """A digest of the tfmgpu code that runs: every `.py` file of the package
  (its path inside the package and its bytes) but the bench's harness
  (`tfmgpu/benchmarks/`, `tfmgpu/bench.py`), read once per process.

  Args:
    package_dir: the package's directory. Defaults to this module's
      `tfmgpu` (the one that runs).
  """
  if package_dir is None:
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for root, dirs, names in os.walk(package_dir):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (
        root == package_dir and d in _HARNESS))
    for name in sorted(n for n in names if n.endswith(".py") and not (
        root == package_dir and n in _HARNESS)):
      path = os.path.join(root, name)
      digest.update(os.path.relpath(path, package_dir).encode() + b"\0")
      with open(path, "rb") as f:
        digest.update(f.read() + b"\0")
  return digest.hexdigest()[:16]


def machine_key() -> dict[str, Any]:
  """What about this machine and process the measurements depend on."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  gpus = [tf.config.experimental.get_device_details(g).get("device_name", "GPU")
          for g in tf.config.list_physical_devices("GPU")]
  return {"cpu": cpu_model(), "cores": devices_lib.cpu_cores(),
          "threads_per_op":
              tf.config.threading.get_intra_op_parallelism_threads(),
          "gpus": gpus, "tensorflow": tf.__version__,
          "onednn": _compat.onednn_enabled(),  # Other kernels, other speeds.
          "tfmgpu_code": code_version()}


def cache_path() -> str:
  """`autotune.json` in the tfmgpu cache directory."""
  return os.path.join(data_lib.cache_dir(), CACHE_FILE)


def _digest(key: Mapping[str, Any]) -> str:
  text = json.dumps({"format": _CACHE_FORMAT, **key}, sort_keys=True,
                    default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read_cache(path: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      entries = json.load(f)
    if not isinstance(entries, dict):
      raise ValueError("not a JSON object")
    return entries
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    logging.warning("Ignoring the unreadable autotune cache %s (%s); it will "
                    "be rewritten.", path, e)
    return {}


def _write_cache(path: str, digest: str, entry: dict[str, Any]) -> None:
  """Adds `entry` to the cache file, atomically; skips an unwritable one."""
  entries = _read_cache(path)
  entries[digest] = entry
  text = json.dumps(entries, indent=1)  # Candidates keep their order.
  try:
    files.write_atomically(path, lambda f: f.write(text.encode("utf-8")))
  except OSError as e:
    logging.info("Not caching the autotune choice in %s (%s); set "
                 "TFMGPU_CACHE_DIR to a writable directory.", path, e)


# ---------------------------------------------------------------- search

def _time_rounds(measure: Callable[[Settings], float],
                 candidates: dict[str, Settings], rounds: int,
                 failed: dict[str, str]) -> dict[str, list[float]]:
  """Each candidate's ms per step in each of `rounds` interleaved rounds.

  A candidate whose `measure` raises `ValueError` (an impossible option
  here) is dropped and named in `failed`.
  """
  times: dict[str, list[float]] = {}
  for _ in range(rounds):
    for label, settings in candidates.items():
      if label in failed:
        continue
      try:
        ms = float(measure(settings))
      except ValueError as e:
        failed[label] = str(e).splitlines()[0]
        times.pop(label, None)
        continue
      times.setdefault(label, []).append(ms)
  return times


def _time_all(measure: Callable[[Settings], float],
              candidates: dict[str, Settings], rounds: int,
              failed: dict[str, str]) -> dict[str, float]:
  """Each candidate's best ms per step over `rounds` interleaved rounds."""
  return {label: min(ms) for label, ms in
          _time_rounds(measure, candidates, rounds, failed).items()}


@dataclasses.dataclass(frozen=True)
class Paired:
  """A finalist's speed-ups over the current settings in paired rounds."""
  median: float
  worst: float

  def holds(self, margin: float) -> bool:
    """Faster by `margin` in the median round and slower in none."""
    return self.median >= 1 + margin and self.worst >= 1.0

  def __str__(self) -> str:
    return f"{self.median:.2f}x (worst {self.worst:.2f}x)"


def _paired_speedups(measure: Callable[[Settings], float],
                     finalists: dict[str, Settings], rounds: int,
                     failed: dict[str, str]) -> dict[str, Paired]:
  """Each finalist's speed-ups over `"current"` in `rounds` paired rounds
  (each round times the current settings and every finalist back to
  back): their median and the worst."""
  times = _time_rounds(measure, finalists, rounds, failed)
  base = times.get("current")
  if not base:
    return {}
  ratios = {label: [b / t for b, t in zip(base, ms)]
            for label, ms in times.items() if label != "current"}
  return {label: Paired(statistics.median(r), min(r))
          for label, r in ratios.items()}


def _best(speedups: dict[str, Paired], margin: float) -> str | None:
  """The finalist with the highest median of those that hold, if any."""
  holding = [label for label, p in speedups.items() if p.holds(margin)]
  return max(holding, key=lambda label: speedups[label].median,
             default=None)


def _winners(current: Settings, singles: dict[str, Settings],
             times: dict[str, float], margin: float) -> dict[str, Any]:
  """Per option, its fastest value if that beats `current` by `margin`."""
  base = times["current"]
  wins: dict[str, tuple[Any, float]] = {}
  for label, settings in singles.items():
    if label == "current" or label not in times:
      continue
    (name, value), = current.changes(settings).items()
    if base / times[label] >= 1 + margin and (
        name not in wins or times[label] < wins[name][1]):
      wins[name] = (value, times[label])
  return {name: value for name, (value, _) in wins.items()}


def _search(measure: Callable[[Settings], float], current: Settings,
            space: Mapping[str, tuple], *, rounds: int, margin: float
            ) -> tuple[Settings, dict[str, float], str]:
  """One option changed at a time; then the best change and the winners
  together, measured again in `rounds + 1` paired rounds beside `current`:
  a pick must win the first rounds and every paired round."""
  singles = {"current": current}
  for name in TUNED:
    for value in space.get(name, ()):
      if value != getattr(current, name):
        singles[changes_label({name: value})] = dataclasses.replace(
            current, **{name: value})
  failed: dict[str, str] = {}
  times = _time_all(measure, singles, rounds, failed)
  if "current" not in times:
    raise ValueError(f"autotune could not measure the current settings "
                     f"({changes_label(current.as_dict())}): "
                     f"{failed['current']}")
  wins = _winners(current, singles, times, margin)
  if not wins:
    return current, times, _reason(current, times, failed, margin, {})
  finalists = {"current": current}
  name, value = min(wins.items(),
                    key=lambda kv: times[changes_label(dict([kv]))])
  finalists[changes_label({name: value})] = dataclasses.replace(
      current, **{name: value})
  if len(wins) > 1:  # Do the winners add up?
    finalists[changes_label(wins)] = dataclasses.replace(current, **wins)
  speedups = _paired_speedups(measure, finalists, rounds + 1, failed)
  if len(wins) > 1 and changes_label(wins) in speedups:
    times[changes_label(wins)] = (  # On the first rounds' scale.
        times["current"] / speedups[changes_label(wins)].median)
  best = _best(speedups, margin)
  chosen = finalists[best] if best else current
  reason = _reason(current, times, failed, margin, speedups, chosen)
  if chosen == current:
    return chosen, times, reason
  refined, said = _on_top(measure, current, chosen, space,
                          rounds=rounds + 1, margin=margin, failed=failed)
  return refined, times, reason + said


def _on_top(measure: Callable[[Settings], float], current: Settings,
            chosen: Settings, space: Mapping[str, tuple], *, rounds: int,
            margin: float, failed: dict[str, str]) -> tuple[Settings, str]:
  """A second pass: each option `chosen` left as it was, changed on top of
  `chosen` (options that pay only together, e.g. batch splits under XLA),
  timed in `rounds` paired rounds beside it; the fastest kept if it holds
  (`Paired.holds`: `margin` in the median round, slower in none).

  Returns:
    `(the settings, a sentence for the reason)`.
  """
  on_top = {"current": chosen}
  for name in TUNED:
    if name in current.changes(chosen):
      continue
    for value in space.get(name, ()):
      if value != getattr(chosen, name):
        settings = dataclasses.replace(chosen, **{name: value})
        on_top[changes_label(current.changes(settings))] = settings
  if len(on_top) == 1:
    return chosen, ""
  speedups = _paired_speedups(measure, on_top, rounds, failed)
  text = (" Then each other option on top of it, in paired rounds beside it "
          "(the median round): " + ", ".join(
              f"{label} {x}" for label, x in speedups.items()))
  best = _best(speedups, margin)
  if best is None:
    return chosen, text + "; none added."
  return on_top[best], text + f"; picked {best}."


def _reason(current: Settings, times: dict[str, float],
            failed: dict[str, str], margin: float,
            speedups: dict[str, Paired], chosen: Settings | None = None
            ) -> str:
  """Each candidate's speed-up over `current`, the check, and the pick."""
  base = times["current"]
  cells = [f"{label} {base / ms:.2f}x" for label, ms in times.items()
           if label != "current"]
  text = (f"Speed-up over the current settings ({base:.3f} ms/step; best "
          f"round of each): {', '.join(cells) or 'nothing else to try'}")
  if failed:
    text += "; " + ", ".join(f"{k} impossible here ({v})"
                             for k, v in failed.items())
  if not speedups:
    return text + f". None was faster by {margin:.0%} or more."
  text += (". Measured again in paired rounds beside the current settings "
           "(the median round): " + ", ".join(
               f"{label} {x}" for label, x in speedups.items()))
  picked = current.changes(chosen or current)
  if not picked:
    return text + (f": none faster by {margin:.0%} or more in the median "
                   "round and slower in none; kept them.")
  return (text + f". Picked {changes_label(picked)}: faster by {margin:.0%} "
          "or more in the first rounds and in the median paired round, "
          "slower in none.")


def tune(measure: Callable[[Settings], float], *, key: Mapping[str, Any],
         current: Settings = Settings(),
         space: Mapping[str, tuple] | None = None, enabled: bool = True,
         rounds: int = 2, margin: float = 0.05,
         cache: str | None = None, cached_only: bool = False) -> Choice:
  """The fastest settings for `key`, from the cache or measured now.

  Args:
    measure: `measure(settings)` -> ms per optimizer step of a short run
      (raises `ValueError` for settings impossible here).
    key: what the measurements depend on besides the settings: at least
      `model` (e.g. `model_signature`) and `replicas`; `machine_key()` is
      added.
    current: the settings to start from; returned unchanged when `enabled`
      is false or nothing is faster by `margin`.
    space: the values to try per option. Defaults to `search_space`.
    enabled: `False` measures nothing and returns `current`.
    rounds: interleaved rounds per candidate (best kept).
    margin: a change must be this much faster (0.05: 5%).
    cache: the cache file. Defaults to `cache_path()`.
    cached_only: measure nothing: a choice not in the cache is `current`
      (source `"not cached"`).

  Returns:
    A `Choice` (its `describe()` is logged).

  Raises:
    ValueError: `key` without `model` or `replicas`, `rounds < 1`, or the
      current settings cannot be measured.
  """
  if not enabled:
    return Choice(current, current, {}, "Autotune is off: the given settings "
                  "are used.", "off")
  missing = [k for k in ("model", "replicas") if k not in key]
  if missing or rounds < 1:
    raise ValueError(f"key={dict(key)!r} needs {missing} and rounds={rounds} "
                     "must be >= 1; pass key={'model': "
                     "model_signature(model), 'replicas': n, ...}.")
  space = dict(space if space is not None
               else search_space(current, replicas=int(key["replicas"])))
  full_key = {**machine_key(), **key, "current": current.as_dict(),
              "space": space, "margin": margin}
  digest, path = _digest(full_key), cache or cache_path()
  entry = _read_cache(path).get(digest)
  if entry is not None:
    choice = Choice(Settings(**entry["settings"]), current,
                    dict(entry["times_ms"]), entry["reason"], "cache")
  elif cached_only:
    choice = Choice(current, current, {}, "Not in the cache and not "
                    "measured now: the given settings are used.", "not cached")
  else:
    chosen, times, reason = _search(measure, current, space, rounds=rounds,
                                    margin=margin)
    choice = Choice(chosen, current, times, reason, "measured")
    _write_cache(path, digest, {
        "key": full_key, "settings": chosen.as_dict(), "times_ms": times,
        "reason": reason, "measured": datetime.datetime.now().isoformat(
            timespec="seconds")})
  logging.info("%s", choice.describe())
  return choice


# ---------------------------------------------------------------- timing

class TrainerTimer:
  """`measure(settings)`: ms per step of a `Trainer.fit` (median call).

  Each settings' `Trainer` (a model from `build`, its optimizer and compiled
  step) is made on its first call and reused by later rounds, so only the
  first pays for tracing and XLA compilation. Each measurement trains whole
  epochs of the data's full batches, at least `calls` + 1 step calls, and
  returns the median call after the first (a long window: the machine's
  drift within it moves the median little).

  Args:
    build: makes a fresh model (called in `strategy.scope()`).
    strategy: the strategy to train under.
    x, y: training arrays.
    global_batch_size: examples per step.
    calls: the fewest timed `tf.function` calls per measurement.
    clock: the clock (`time.perf_counter`).
    trainer_options: other `Trainer` arguments, fixed for every candidate.
  """

  def __init__(self, build: Callable[[], Any], strategy: Any, x: Any, y: Any,
               *, global_batch_size: int, calls: int = 4,
               clock: Callable[[], float] = time.perf_counter,
               **trainer_options: Any):
    self._build, self._strategy = build, strategy
    self._x, self._y = x, y
    self._batch, self._calls, self._clock = global_batch_size, calls, clock
    self._options = trainer_options
    self._trainers: dict[Settings, Any] = {}
    self._stamps: list[float] = []

  def _trainer(self, settings: Settings) -> Any:
    if settings not in self._trainers:
      import keras  # pylint: disable=g-import-not-at-top
      from tfmgpu.training.loop import Trainer  # pylint: disable=g-import-not-at-top
      stamps, clock = self._stamps, self._clock

      class _Stamp(keras.callbacks.Callback):

        def on_train_batch_end(self, batch, logs=None):
          stamps.append(clock())

      with self._strategy.scope():
        model = self._build()
      self._trainers[settings] = Trainer(
          model, strategy=self._strategy, verbose=0, callbacks=[_Stamp()],
          **self._options, **settings.as_dict())
    return self._trainers[settings]

  def __call__(self, settings: Settings) -> float:
    trainer = self._trainer(settings)
    full = len(self._x) // self._batch
    spe = settings.steps_per_execution
    per_call = min(spe, full)
    per_epoch = max(full // per_call, 1) * per_call
    steps = per_call * (self._calls + 1)
    self._stamps.clear()
    trainer.fit(self._x, self._y, epochs=-(-steps // per_epoch),
                global_batch_size=self._batch, steps_per_epoch=per_epoch)
    gaps = [b - a for a, b in zip(self._stamps, self._stamps[1:])]
    if not gaps:
      raise RuntimeError("autotune timed no step calls; give it more data "
                         f"than {len(self._x)} rows.")
    return statistics.median(gaps) * 1e3 / per_call

  def close(self) -> None:
    """Drops the candidates' trainers (and their models)."""
    for trainer in self._trainers.values():
      trainer.close()
    self._trainers.clear()


def tune_training(build: Callable[[], Any], strategy: Any, x: Any, y: Any, *,
                  global_batch_size: int, current: Settings = Settings(),
                  enabled: bool = True, rounds: int = 2,
                  cache: str | None = None, cached_only: bool = False,
                  max_steps_per_execution: int | None = None,
                  **trainer_options: Any) -> Choice:
  """`tune` with `TrainerTimer`: the fastest settings to train `build()`'s
  model under `strategy` with this batch.

  Only one-host strategies are tuned (a multi-worker or parameter-server
  run keeps `current`: every worker must train with the same options).

  Args:
    build: makes the model (called in `strategy.scope()`); one extra copy
      is built per candidate.
    strategy, x, y, global_batch_size: what training will use.
    current, enabled, rounds, cache, cached_only: see `tune`.
    max_steps_per_execution: try no more steps per call than this (e.g.
      `current.steps_per_execution`: keep a comparison's steps per call);
      at most the data's full batches.
    trainer_options: other `Trainer` arguments (e.g. `optimizer`).
  """
  from tfmgpu.training import batch_splits  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import resident  # pylint: disable=g-import-not-at-top
  if not enabled:
    return tune(lambda s: 0.0, key={}, current=current, enabled=False)
  if not resident.supports(strategy):
    return Choice(current, current, {}, f"Not tuned: {type(strategy).__name__}"
                  " is not a one-host strategy (mirrored, one_device, "
                  "default); the workers of a multi-worker or parameter-"
                  "server run must all train with the same options.", "off")
  full = len(x) // global_batch_size
  if full < 1:
    raise ValueError(f"global_batch_size={global_batch_size} is larger than "
                     f"the {len(x)} training rows; use a smaller batch.")
  with strategy.scope():
    model = build()
  signature = model_signature(model)
  replicas = strategy.num_replicas_in_sync
  splittable = (batch_splits.problem(model) is None
                and global_batch_size >= 2 * replicas)
  timer = TrainerTimer(build, strategy, x, y,
                       global_batch_size=global_batch_size, **trainer_options)
  try:
    return tune(timer, key={"model": signature, "replicas": replicas,
                            "strategy": type(strategy).__name__,
                            "global_batch_size": global_batch_size,
                            "trainer_options": sorted(trainer_options.items())},
                current=current, rounds=rounds, cache=cache,
                cached_only=cached_only,
                space=search_space(current, replicas=replicas,
                                   max_steps_per_execution=min(
                                       full, max_steps_per_execution or full),
                                   splittable=splittable))
  finally:
    timer.close()
