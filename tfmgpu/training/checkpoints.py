"""Checkpoints: save every epoch (and on preemption), resume, chief-only writes.

A checkpoint holds the model, the optimizer, the state of the model's
random-number generators (`seed_states`: Dropout's masks) and the training
position: the epochs completed, the steps done in the next epoch, and the
global step.
Every save takes a number never used before in the directory: `ckpt-N` for
the end of epoch N or a preemption during epoch N when N is free, otherwise
the next free number (a run preempted during epoch 3 saves `ckpt-3`; the
resumed run saves the end of epoch 3 as `ckpt-4`, not over `ckpt-3`). The
position is read from inside the checkpoint (`Progress`), never from its
name. A resumed run skips the steps already done in its first epoch, so with
the same `global_batch_size` it sees exactly the data of an uninterrupted run
(`inputs.epoch_order`), whatever the number of workers or replicas.

Durability: a checkpoint's files and directory are fsynced before the
`checkpoint` state file (itself written aside, fsynced and renamed) names it;
old checkpoints beyond `max_to_keep` are deleted only after that. Restore
takes the newest checkpoint that reads back, logging each one skipped and
why (a skipped one is left on disk, not counted among those kept);
checkpoints are also found by scanning the directory, so a missing or
damaged state file never hides them. When checkpoints exist but none reads
back, restore raises `UnreadableCheckpointError` rather than training from
scratch over them. A save that fails (a full disk) deletes what it wrote of
its own number and raises `OSError` (`errno.ENOSPC` when the disk is full,
naming the directory); the checkpoints saved before are untouched.

Learning rate: a resumed run trains with the rate the stopped run went on
with (one that `ReduceLROnPlateau` lowered after the epoch's checkpoint,
recorded by `note_learning_rate`), unless given another one (a new
`--learning_rate`), which wins, as the NaN error's advice expects
(`resume_rate`).

Preemption: while `Trainer.fit` runs with a `model_dir`, SIGTERM (what
schedulers send before they kill a job) is caught; at the next step boundary
every worker saves a checkpoint and `fit` raises `PreemptedError`. The CLI
(`python -m tfmgpu.train`) then exits with `EXIT_PREEMPTED` (42): rerun the
same command to resume from the saved step; a script that leaves the error
uncaught exits with 42 too. A worker killed without notice
(SIGKILL, a crashed host) leaves the last checkpoint written.

Multi-worker: every worker restores from the chief's directory
(`model_dir/checkpoints`, which must be on a filesystem all workers see:
`workers.require_same_start` refuses a resume where they read different
ones) and
takes part in saving, but only the chief's files are kept: the others write
to a temporary directory that `close()` removes, or else the garbage
collector or the interpreter's exit (a finalizer: a Python run that never
called `Trainer.close()` left one per run in /tmp). A worker killed by
SIGKILL runs neither: its directory (`tfmgpu-ckpt-PID-NS-HOST-...`, a whole
checkpoint copy) is removed by the next `Checkpointer` made on that host
(`remove_stale_worker_copies`) in the same PID namespace.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import re
import shutil
import stat
import sys
import tempfile
import weakref
from collections.abc import Sequence

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import files
from tfmgpu import rundir
from tfmgpu.parallel import placed_model
from tfmgpu.training import checkpoint_match
from tfmgpu.training import portable
from tfmgpu.training import resume_rate
from tfmgpu.training import seed_states
from tfmgpu.training import slot_order

# Exit code of `python -m tfmgpu.train` when SIGTERM stopped training after a
# checkpoint was saved: "preempted, restart me". (143 = 128 + SIGTERM means a
# process died of SIGTERM without saving.)
EXIT_PREEMPTED = 42


class PreemptedError(RuntimeError):
  """Training stopped on SIGTERM after saving a checkpoint; rerun to resume.

  Attributes:
    checkpoint: the checkpoint saved (the chief's path; a temporary path on
      other workers).
    step: the global step saved.
  """

  def __init__(self, message: str, *, checkpoint: str | None, step: int):
    super().__init__(message)
    self.checkpoint = checkpoint
    self.step = step
    _exit_preempted_when_uncaught()


def _exit_preempted_when_uncaught() -> None:
  """Chains `sys.excepthook` (once) so that an uncaught `PreemptedError`
  is printed as before, then ends the process with `EXIT_PREEMPTED`, as
  the CLI does: a user's script exited 1, which launchers and schedulers
  read as a failure, not a preemption to rerun (a new user's trial). A
  `SystemExit` raised in the hook sets the exit code; atexit handlers
  still run. An error left uncaught in another thread, or a hook installed
  later that does not call this one, still exits 1."""
  previous = sys.excepthook
  if getattr(previous, "tfmgpu_preempted", False):
    return

  def hook(kind, value, traceback):
    try:
      previous(kind, value, traceback)
    finally:
      if isinstance(value, PreemptedError):
        sys.exit(EXIT_PREEMPTED)
  hook.tfmgpu_preempted = True
  sys.excepthook = hook


@dataclasses.dataclass(frozen=True)
class Progress:
  """Where training stands.

  Attributes:
    epoch: epochs completed.
    epoch_step: steps done in the next epoch (0 at an epoch boundary).
    step: optimizer steps done in all (the global step).
  """
  epoch: int = 0
  epoch_step: int = 0
  step: int = 0


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  """True for the task that owns outputs (the only task, or the chief/worker 0)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.task_type:
    return True
  cluster = resolver.cluster_spec().as_dict()
  if "chief" in cluster:
    return resolver.task_type == "chief"
  return resolver.task_type == "worker" and resolver.task_id == 0


class UnreadableCheckpointError(RuntimeError):
  """Checkpoints exist but none of them reads back.

  Attributes:
    reasons: `"ckpt-2 (why)"` for each checkpoint tried, newest first.
  """

  def __init__(self, message: str, reasons: Sequence[str] = ()):
    super().__init__(message)
    self.reasons = tuple(reasons)


class OtherRunCheckpointError(UnreadableCheckpointError):
  """The checkpoints read back whole but hold another model's weights or
  another optimizer's variables (`checkpoint_match`)."""


_SUMS = "epoch_sums"  # The epoch's running sums in a checkpoint.
_GIVEN = "given_learning_rate"  # The learning rate its run was given.
_STATE = "checkpoint"  # TF's state file: which checkpoints a directory holds.
_FILE = re.compile(r"^ckpt-(\d+)(?:\.|_temp)")  # A checkpoint's file or temp.


def number_of(path: str) -> int:
  """The number of checkpoint `path` (`ckpt-3` -> 3; -1 if not one)."""
  match = _FILE.match(os.path.basename(path) + ".")
  return int(match.group(1)) if match else -1


def _used_numbers(directory: str) -> set[int]:
  """Numbers with any file in `directory` (complete or not)."""
  if not os.path.isdir(directory):
    return set()
  return {int(m.group(1)) for m in map(_FILE.match, os.listdir(directory))
          if m}


def _complete(directory: str) -> list[str]:
  """Prefixes of the checkpoints with an `.index` file, oldest first."""
  prefixes = [p[:-len(".index")] for p in
              glob.glob(os.path.join(glob.escape(directory), "ckpt-*.index"))]
  return sorted((p for p in prefixes if number_of(p) >= 0), key=number_of)


def _named_in_state(directory: str) -> list[str]:
  """The checkpoints the state file names (none if missing or garbage)."""
  try:
    state = tf.train.get_checkpoint_state(directory)
  except (tf.errors.OpError, ValueError) as e:
    logging.warning("Ignoring the unreadable state file %s (%s); looking for "
                    "checkpoints in the directory.",
                    os.path.join(directory, _STATE), str(e).splitlines()[0])
    return []
  if state is None:
    return []
  # TF has joined relative names to `directory` already; joining again
  # doubled a relative `directory` (`runs/x/checkpoints/runs/x/...`). A name
  # in `directory` is spelt as the scan spells it, so that each appears once.
  here = os.path.abspath(directory)
  return [os.path.join(directory, os.path.basename(p))
          if os.path.dirname(os.path.abspath(p)) == here else p
          for p in [*state.all_model_checkpoint_paths,
                    state.model_checkpoint_path] if p]


def _files_of(prefix: str) -> list[str]:
  return glob.glob(glob.escape(prefix) + ".*")


def _write_state(directory: str, kept: list[str]) -> None:
  """Writes the state file naming `kept` (newest last), whole or not at all."""
  names = [os.path.basename(p) for p in kept]
  text = "".join([f'model_checkpoint_path: "{names[-1]}"\n'] + [
      f'all_model_checkpoint_paths: "{n}"\n' for n in names])
  files.write_atomically(os.path.join(directory, _STATE),
                         lambda f: f.write(text.encode("utf-8")))


def _delete(prefix: str) -> None:
  for path in _files_of(prefix):
    os.remove(path)
  shutil.rmtree(prefix + "_temp", ignore_errors=True)


def describe_position(p: Progress) -> str:
  """Where a checkpoint stands, in words (`after 4 whole epochs, ...`)."""
  if not p.epoch_step:
    whole = "epoch" if p.epoch == 1 else "epochs"
    return f"after {p.epoch} whole {whole}, global step {p.step}"
  return (f"epoch {p.epoch + 1}, step {p.epoch_step} of it, "
          f"global step {p.step}")


# A non-chief worker's copies: `tfmgpu-ckpt-PID-NS-HOST-XXXXXXXX` in the
# temporary directory (NS: `_pid_namespace`; `mkdtemp`'s suffix has no "-").
_WORKER_COPY = re.compile(
    r"^tfmgpu-ckpt-(?P<pid>\d+)-(?P<ns>[A-Za-z0-9]+)-(?P<host>[^-]+)-[^-]+$")


def _pid_namespace() -> str | None:
  """What PIDs are numbered in: `pidns` + the inode of /proc/self/ns/pid;
  `None` where it cannot be read. Containers sharing /tmp and a host name
  see each other's live PIDs as gone, and they share the kernel's boot id
  too, so nothing else tells them apart: without it nothing is swept."""
  try:
    return f"pidns{os.stat('/proc/self/ns/pid').st_ino}"
  except OSError:
    return None


def _worker_copy_prefix() -> str:
  """Names the worker's directory by its PID, PID namespace and host, so
  that a later run can tell when it is left by a killed process."""
  return (f"tfmgpu-ckpt-{os.getpid()}-{_pid_namespace() or 'unknown'}-"
          f"{files.host_name()}-")


def remove_stale_worker_copies(parent: str | None = None) -> list[str]:
  """Deletes the temporary directories of non-chief workers that were
  killed (SIGKILL runs no finalizer) in `parent` (the temporary directory):
  only ours by name, made on this host in this PID namespace (another
  container's live PID can look gone here) and owned by this user, whose
  process is gone (`files.writer_is_gone`). Logs and returns them; never
  raises."""
  parent = parent or tempfile.gettempdir()
  removed = []
  namespace = _pid_namespace()
  try:
    names = os.listdir(parent)
  except OSError:
    return removed
  for name in names:
    match = _WORKER_COPY.match(name)
    if (not match or match.group("host") != files.host_name()
        or namespace is None or match.group("ns") != namespace):
      continue
    path = os.path.join(parent, name)
    try:
      info = os.lstat(path)
    except OSError:
      continue
    # Claimed by another sweep (renamed `.xPID`) still at work? A rename
    # keeps the mtime, so the claim's time is the ctime.
    claimer = re.search(r"\.x(\d+)$", name)
    if (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        and files.writer_is_gone(int(match.group("pid")), info.st_mtime)
        and not (claimer and not files.writer_is_gone(int(claimer.group(1)),
                                                      info.st_ctime))):
      claimed = f"{path}.x{os.getpid()}"  # Still matched if left half-done.
      try:  # One rename wins: workers starting together log it once.
        os.rename(path, claimed)
      except OSError:
        continue
      shutil.rmtree(claimed, ignore_errors=True)
      removed.append(path)
  if removed:
    logging.warning("Removed %d temporary checkpoint director%s left by "
                    "killed non-chief workers: %s.", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
  return removed


class Checkpointer:
  """Saves and restores the model, optimizer and position of a run.

  Args:
    model_dir: the run directory; checkpoints go to `model_dir/checkpoints`.
    strategy: the run's strategy (to decide who writes).
    model, optimizer: what is saved, plus the training position.
    max_to_keep: checkpoints kept. Defaults to `3`.
  """

  def __init__(self, model_dir: str, strategy: tf.distribute.Strategy, *,
               model: keras.Model, optimizer: keras.optimizers.Optimizer,
               max_to_keep: int = 3):
    self.chief = is_chief(strategy)
    # Every worker resumes from the chief's checkpoints.
    # Absolute: multi-worker ZeRO's chief has a serving task write its shard,
    # from its own working directory (a relative runs/x failed there).
    self.chief_directory = os.path.join(os.path.abspath(model_dir),
                                        "checkpoints")
    remove_stale_worker_copies()
    self._tmp = None if self.chief else tempfile.mkdtemp(
        prefix=_worker_copy_prefix())
    self.directory = self.chief_directory if self.chief else self._tmp
    # Removed by `close()`, else when collected or at the interpreter's exit.
    self._remove_tmp = (weakref.finalize(self, shutil.rmtree, self._tmp,
                                         ignore_errors=True)
                        if self._tmp else None)
    self.max_to_keep = max_to_keep
    self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    self.epoch_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  name="epoch_step")
    self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    # The epoch's loss and metric sums so far (mid-epoch; the controller's
    # `StepSums.to_text`), so that a resumed epoch reports all its steps.
    self._epoch_sums = tf.Variable("", dtype=tf.string, trainable=False,
                                   name="epoch_sums")
    # A placed model's weights are also saved by layer name in unsplit form,
    # so the checkpoint restores into any layout (`portable`).
    view = ({portable.VIEW: portable.PortableView(model)}
            if placed_model.is_placed(model) else {})
    self._model = model  # Its variables' order: `slot_order`.
    self._objects = dict(model=model, optimizer=optimizer, epoch=self.epoch,
                         epoch_step=self.epoch_step, step=self.step)
    self._view, self._has_view = view, bool(view)
    # Dropout's random state (Keras seed generators), by layer name: without
    # it a resumed run replays the masks of the first steps.
    seeds = seed_states.SeedStates(model)
    self._seeds = {seed_states.KEY: seeds} if seeds else {}
    self._sums = {_SUMS: self._epoch_sums}
    # The learning rate given to the run that saved (NaN: none, a schedule,
    # an older tfmgpu): a resumed run given the same rate keeps the one its
    # callbacks left (ReduceLROnPlateau's), another rate is the user's.
    self._given_lr = tf.Variable(float("nan"), dtype=tf.float64,
                                 trainable=False, name=_GIVEN)
    self._given = {_GIVEN: self._given_lr}
    self._rate_saved: dict[str, float] = {}  # The last save's rate.
    self.checkpoint = tf.train.Checkpoint(**self._objects, **view,
                                          **self._seeds, **self._sums,
                                          **self._given)
    # Saves counted as `tf.train.CheckpointManager` did, so that checkpoints
    # of either kind restore with every object matched.
    self._saves = self.checkpoint.save_counter
    self._latest: str | None = None  # Restored or saved (the chief's name).
    self.restored: str | None = None  # What `restore_latest` read, if any.
    self._last_number: int | None = None  # Highest number seen or used.
    # Checkpoints the restore skipped as unreadable (basenames): kept on
    # disk, but not counted among the `max_to_keep` (they pushed out the
    # readable ones a resumed run fell back to).
    self._unreadable: set[str] = set()

  @property
  def latest(self) -> str | None:
    """The newest checkpoint of the run (the chief's copy, which is kept).

    The one restored or saved by this object, else the one the chief's state
    file names.
    """
    return self._latest or tf.train.latest_checkpoint(self.chief_directory)

  @property
  def epoch_sums(self) -> str:
    """The running sums of the epoch saved mid-epoch (`""` at an epoch's
    end, or in a checkpoint of an older tfmgpu)."""
    return self._epoch_sums.numpy().decode("utf-8")

  @property
  def progress(self) -> Progress:
    """The position saved in (or restored from) the checkpoint."""
    return Progress(int(self.epoch.numpy()), int(self.epoch_step.numpy()),
                    int(self.step.numpy()))

  def candidates(self) -> list[str]:
    """The chief's checkpoints, newest first: found by scanning the directory
    and named by its state file (which may name deleted ones)."""
    found = set(_complete(self.chief_directory))
    found.update(_named_in_state(self.chief_directory))
    return sorted(found, key=number_of, reverse=True)

  def restore_latest(self) -> int:
    """Restores the chief's newest checkpoint that reads back.

    A checkpoint that fails to read (a truncated, emptied or deleted file) is
    logged with the reason and skipped for the next older one.

    Returns:
      Epochs completed (`0` without checkpoints); `progress` then says how
      far into the next epoch it was saved.

    Raises:
      UnreadableCheckpointError: checkpoint files exist but none reads back.
    """
    self._last_number = max(_used_numbers(self.chief_directory), default=0)
    self.restored = None
    slot_order.check(self.chief_directory, slot_order.order_of(self._model))
    optimizer = self.checkpoint.optimizer
    lr = resume_rate.rate_variable(optimizer)
    given = float(lr.numpy()) if lr is not None else None
    skipped = []
    for path in self.candidates():
      try:
        status = self._read(path)
      # TF's reader maps damage to OpErrors, IndexError (a short read),
      # ValueError, protobuf DecodeError ...: each means "does not read".
      except Exception as e:  # pylint: disable=broad-except
        why = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        logging.warning("Skipping checkpoint %s: it does not read back (%s). "
                        "Trying the next older one.", path, why)
        skipped.append(f"{os.path.basename(path)} ({why})")
        self._unreadable.add(os.path.basename(path))
        continue
      try:
        status.assert_existing_objects_matched()
      except AssertionError as e:
        raise self._moved_error() or self._other_run_error(
            path, str(e).splitlines()[0]) from e
      self._resume_learning_rate(optimizer, given, path)
      self._latest = self.restored = path
      logging.info("Resumed from %s: %s.", path,
                   describe_position(self.progress))
      return self.progress.epoch
    self._check_nothing_left(skipped)
    self._given_lr.assign(float("nan") if given is None else given)
    return 0

  def _resume_learning_rate(self, optimizer, given: float | None,
                            path: str) -> None:
    """After restoring `path`: the learning rate its run went on with,
    unless this run was given another (`resume_rate.resumed_rate`)."""
    kept = resume_rate.resumed_rate(optimizer, given,
                                    float(self._given_lr.numpy()), path,
                                    self.chief_directory)
    self._given_lr.assign(float("nan") if kept is None else kept)

  def note_learning_rate(self, path: str) -> None:
    """Records the rate the run goes on with from `path`, the epoch's
    checkpoint, when the callbacks changed it after it was written."""
    variable = resume_rate.rate_variable(self.checkpoint.optimizer)
    if not self.chief or variable is None or path is None:
      return
    rate = float(variable.numpy())
    if rate != self._rate_saved.get(path, rate):
      resume_rate.record(self.chief_directory, path, rate)

  def _read(self, path: str):
    """Restores checkpoint `path`; returns the restore's status.

    A checkpoint without the portable view (saved before tfmgpu wrote one),
    without some layers' seed states (saved by an older tfmgpu, or by a
    layout without them) or without the epoch's sums (an older tfmgpu) is
    read without them, so that every object it holds is still matched; the
    seed states it lacks stay as they are.
    """
    names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    view = self._has_view and portable.has_view(path)
    seeds = self._seeds_held(path, seed_states.held_in(names))
    sums = self._sums if f"{_SUMS}/.ATTRIBUTES/VARIABLE_VALUE" in names else {}
    given = (self._given if f"{_GIVEN}/.ATTRIBUTES/VARIABLE_VALUE" in names
             else {})
    self._epoch_sums.assign("")
    self._given_lr.assign(float("nan"))
    if view == self._has_view and seeds is self._seeds and sums and given:
      return self.checkpoint.restore(path)
    partial = tf.train.Checkpoint(**self._objects, **seeds, **sums, **given,
                                  **(self._view if view else {}))
    status = partial.restore(path)
    self._saves.assign(partial.save_counter)
    return status

  def _seeds_held(self, path: str, held: set[str]) -> dict[str, object]:
    """`self._seeds`, or the part of it checkpoint `path` holds (`held`:
    layer names), saying which layers keep their current seed state."""
    if not self._seeds:
      return self._seeds
    ours = self._seeds[seed_states.KEY].layer_names
    if held.issuperset(ours):
      return self._seeds
    logging.info(
        "%s holds no seed state of layers %s (saved by an older tfmgpu, or "
        "by another model): their random masks (Dropout) continue from the "
        "model's current state, not from where the saved run left them.",
        path, ", ".join(sorted(set(ours) - held)))
    part = seed_states.SeedStates(self._model, only=held)
    return {seed_states.KEY: part} if part else {}

  def _moved_error(self) -> Exception | None:
    """The error of a resume in a layout whose variables the checkpoints'
    slots cannot follow (`slot_order.moved_error`), or `None`."""
    difference = slot_order.other_variables(
        self.chief_directory, slot_order.order_of(self._model))
    if difference is None:
      return None
    return slot_order.moved_error(self.chief_directory, difference)

  def _check_nothing_left(self, skipped: list[str]) -> None:
    """Raises if checkpoint files exist although none read back."""
    if not skipped:
      return
    moved = self._moved_error()
    if moved is not None:
      raise moved
    files = sorted(f for f in os.listdir(self.chief_directory)
                   if _FILE.match(f))
    newest = next((p for p in self.candidates()
                   if os.path.exists(p + ".index")), None)
    if newest and checkpoint_match.reads_back_whole(newest):
      raise self._other_run_error(newest, skipped[0].split(" (", 1)[-1][:-1])
    if not files:
      logging.warning("The state file in %s names %s, but no checkpoint file "
                      "exists: starting from scratch.", self.chief_directory,
                      ", ".join(skipped))
      return
    raise UnreadableCheckpointError(
        f"No checkpoint in {self.chief_directory} reads back: "
        f"{'; '.join(skipped)} (files: {', '.join(files)}). Not training "
        "from scratch over them: restore the directory from a copy, or move "
        "it aside to start a new run.", skipped)

  def _other_run_error(self, path: str, why: str
                       ) -> "OtherRunCheckpointError":
    """The error of checkpoints that read back whole but do not restore
    into this run's model or optimizer, naming what differs."""
    found = checkpoint_match.differences(path, self.checkpoint.optimizer)
    return OtherRunCheckpointError(
        f"The checkpoints in {self.chief_directory} are of another model or "
        f"optimizer than this run's: {os.path.basename(path)} reads back "
        "whole, but its variables do not match"
        + (f" ({'; '.join(found)})" if found else "") + f". TF: {why} Resume "
        "with the model and optimizer that wrote them, or give another "
        "model_dir to start a new run (the checkpoints are left as they "
        "are).", [f"{os.path.basename(path)} ({why})"])

  def save(self, epoch: int, *, step: int | None = None,
           epoch_step: int = 0, epoch_sums: str = "") -> str:
    """Saves the position under a new number; returns the path.

    The path is the chief's, or a temporary one on other workers. The files
    are fsynced before the state file names them.

    Args:
      epoch: epochs completed.
      step: the global step. Defaults to the last one saved or restored.
      epoch_step: steps done in epoch `epoch + 1` (a preemption mid-epoch);
        `0` at an epoch end. The number is that of the epoch the save belongs
        to (`epoch`, or `epoch + 1` mid-epoch) unless a save already used it
        or a higher one; then the next free one.
      epoch_sums: the loss and metric sums of those `epoch_step` steps
        (opaque text, read back as `epoch_sums`).

    Raises:
      rundir.RunDirLockedError: the model_dir was deleted and another run
        has taken it since (`rundir.keep_run_dir`): nothing is written.
      OSError: the write failed (`_write`).
    """
    self.epoch.assign(epoch)
    self.epoch_step.assign(epoch_step)
    self._epoch_sums.assign(epoch_sums)
    if step is not None:
      self.step.assign(step)
    if self._last_number is None:
      self._last_number = max(_used_numbers(self.chief_directory), default=0)
    number = max(epoch + (1 if epoch_step else 0), self._last_number + 1)
    self._last_number = number
    if self.chief:  # The model_dir deleted meanwhile: its lock put back.
      rundir.keep_run_dir(os.path.dirname(self.chief_directory))
    os.makedirs(self.directory, exist_ok=True)
    self._saves.assign_add(1)
    path = self._write(os.path.join(self.directory, f"ckpt-{number}"))
    self._commit(path)
    if self.chief:  # What order its optimizer slots belong to.
      slot_order.write(self.directory, slot_order.order_of(self._model))
    self._latest = self.chief_path(path)
    variable = resume_rate.rate_variable(self.checkpoint.optimizer)
    self._rate_saved = ({path: float(variable.numpy())}
                        if variable is not None else {})
    return path

  def _write(self, prefix: str) -> str:
    """Writes checkpoint `prefix`; on failure deletes what it wrote.

    Raises:
      OSError: the write failed; `errno.ENOSPC` when the disk is full,
        `EDQUOT` / `EFBIG` at a quota / file-size limit (`files.no_room`).
    """
    try:
      return self.checkpoint.write(prefix)
    except (tf.errors.OpError, OSError) as e:
      _delete(prefix)  # Never named: its partial files only take space.
      limit = files.no_room(e) or (
          errno.ENOSPC if isinstance(e, tf.errors.ResourceExhaustedError)
          else None)
      if limit is not None:
        raise OSError(limit, f"{os.strerror(limit)}; "
                      f"{os.path.basename(prefix)} was not saved, the "
                      "checkpoints before it are intact", self.directory
                      ) from e
      raise

  def _commit(self, path: str) -> None:
    """fsync, name in the state file, then delete the oldest beyond max."""
    for f in _files_of(path):
      files.fsync_path(f)
    files.fsync_path(self.directory)
    complete = [c for c in _complete(self.directory)  # `path` the newest.
                if os.path.basename(c) not in self._unreadable]
    kept = complete[-self.max_to_keep:]
    _write_state(self.directory, kept)
    for old in complete:
      if old not in kept:
        _delete(old)

  def chief_path(self, path: str) -> str:
    """The chief's copy of checkpoint `path` (the one that is kept)."""
    return os.path.join(self.chief_directory, os.path.basename(path))

  def close(self) -> None:
    """Removes a non-chief worker's temporary directory now (else it goes
    when this object is collected, or when Python exits)."""
    if self._remove_tmp is not None:
      self._remove_tmp()
      self._tmp = None
