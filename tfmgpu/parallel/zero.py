"""Sharded data parallelism on one host: ZeRO stages 1, 2 and 3.

Data parallelism (`mirrored`) keeps a whole copy of the weights, gradients
and optimizer slots on every device. `ShardedModel` holds one model whose
every variable has an *owner* among the `R` data-parallel devices (balanced
by bytes, `assign_owners`) and trains it as `R` replicas:

1. the batch is split into `R` near-equal slices, one per replica device
   (a short last batch too, each slice weighted by its rows);
2. each replica's forward and backward run on its device
   (`model.stateless_call` on that replica's weight values, one tape), its
   loss averaged over the *global* batch, so the replicas' gradients add up
   to the gradient of the whole batch;
3. each variable's gradients are summed on its owner (a reduce-scatter:
   no device receives a gradient it does not own), clipped to a global norm
   computed over every owner's shard (`clip_norm`), and sent in 16 bits if
   asked (`compression`);
4. the optimizer applies each sum on the owner, where the variable and its
   slots live (`colocate_optimizer_updates`): every slot exists once.

The stages differ in what each device keeps between steps:

- stage 1 and 2: every replica device also keeps a copy of every weight it
  does not own; the copies take the owners' new values at the start of the
  next training step (the all-gather). In a TF graph a step's gradients are
  tensors freed once sent to their owner, so stage 1 runs stage 2's step:
  no device keeps whole gradients beyond the step (the accounting counts
  stage 1's gradients whole, as DeepSpeed's stage 1 keeps them);
- stage 3: no copies. Each replica's forward reads the owners' variables
  across devices (TF sends them, and frees the received values after the
  backward that uses them).

Stage 3 reads each weight once per step: TF keeps the received value for
the backward (a layer's weights are not gathered again for its backward,
nor prefetched layer by layer), so a step's peak still holds every weight
a replica received; between steps each device holds only its own.

Batch-norm statistics and other non-trainable weights live on their owners
in every stage; each replica updates them from its own slice and the owner
keeps the mean of the replicas' new values. (Under Keras 3,
`MirroredStrategy` lets each replica's statistics drift apart and saves the
first replica's; an exponential average being linear, the mean kept here
equals the mean of those copies.)

From the outside it is one Keras model: `fit`, `predict` (the batch split
over the replicas), weights to and from the unsplit model, which it holds
(`to_unsplit`, `weighted_layers`: checkpoints restore into any layout). Its
checkpoints have the keys of the unsplit model's, so a run resumes across
stages and from or into plain `mirrored`.

Its devices may be in other processes: after
`tf.config.experimental_connect_to_cluster`, devices such as
`/job:worker/replica:0/task:1/device:CPU:0` keep their weights and slots
in that task's process, driven by this client (in-graph;
tests/cluster/test_zero_in_graph.py). `multi_worker_mirrored
--zero_stage=N` runs so: its chief drives the other tasks, which only
serve (`tfmgpu.in_graph`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import cloning
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import microbatch
from tfmgpu.parallel import placed
from tfmgpu.parallel import replicated
from tfmgpu.parallel.zero_shards import assign_owners
from tfmgpu.parallel.zero_shards import bytes_by_device
from tfmgpu.parallel.zero_shards import check_stage
from tfmgpu.parallel.zero_shards import Copies
from tfmgpu.parallel.zero_shards import device_name
from tfmgpu.parallel.zero_shards import optimizer_slots
from tfmgpu.parallel.zero_shards import read_on_owner
from tfmgpu.parallel.zero_shards import unique
from tfmgpu.parallel.zero_shards import variable_bytes
from tfmgpu.training import allreduce as allreduce_lib

__all__ = ["ShardedModel", "assign_owners", "bytes_by_device", "check_stage",
           "device_name", "read_on_owner", "variable_bytes"]


class ShardedModel(placed.PerDeviceGradientModel):
  """One model trained as data-parallel replicas, its state sharded (ZeRO).

  Example (stage 3 over 4 devices):

    model = build()                            # anywhere, e.g. on the host
    sharded = tfmgpu.parallel.ShardedModel(model, devices, stage=3)
    trainer = tfmgpu.Trainer(sharded, optimizer="adam")   # default strategy
    trainer.fit(x, y, global_batch_size=64)    # 16 rows per device

  Args:
    model: a built Keras model; its variables move to their owners.
    devices: the data-parallel devices (`R`), e.g. `["/cpu:0", "/cpu:1"]`.
    stage: `1`, `2` or `3` (see the module's docstring). Defaults to `3`.

  Attributes:
    unsplit: `model`, holding the weights (each variable on its owner).
    stage: the ZeRO stage.
    owners: `{variable path: device}` of every weight.
  """

  places_itself = True

  def __init__(self, model: keras.Model, devices: Sequence[str], *,
               stage: int = 3, name: str | None = None, **kwargs):
    stage = check_stage(stage)
    if stage == 0:
      raise ValueError("zero_stage=0 keeps a whole copy on every device: that "
                       "is plain data parallelism (--strategy=mirrored "
                       "without --zero_stage). ShardedModel takes 1, 2 or 3.")
    devices = list(devices)
    if not devices:
      raise ValueError("devices=[] is empty; give the data-parallel devices, "
                       "e.g. ['/cpu:0', '/cpu:1'].")
    # This process's devices must exist: TF would place a shard meant for a
    # missing GPU on another device, silently (a cluster's are the job's).
    devices_lib.resolve_devices([d for d in devices if tf.DeviceSpec.from_string(
        d if d.startswith("/") else "/" + d).job is None])
    if not model.weights:
      raise ValueError(f"model {model.name!r} has no weights: build it (give "
                       "it a keras.Input or call it once) before sharding.")
    checks.refuse_custom_steps(model)
    checks.refuse_stateful_layers(model, f"sharded by ZeRO (ShardedModel, "
                                  f"stage {stage})")
    super().__init__(name=name or f"{model.name}_zero{stage}", **kwargs)
    self.unsplit = model
    self.record_source_policy(model)
    self.stage = stage
    self._devices = tuple(devices)
    replicated.warn_unsynchronized_norms(model, len(devices), self.name)
    # Activity regularisers' losses (per example: exact on replicas).
    # and weight regularisers' (counted once a step): not a batch statistic.
    self._activity_losses = sum(
        getattr(l, "activity_regularizer", None) is not None
        for l in _compat.flatten_layers(model)) + sum(
            getattr(v, "regularizer", None) is not None
            for v in model.trainable_weights)
    # Seed generators' states (Dropout) are variables but not weights.
    weights = unique(list(model.weights) + list(model.non_trainable_variables))
    owners = assign_owners([variable_bytes(v) for v in weights], len(devices))
    for v, owner in zip(weights, owners):
      _compat.rehome_variable(v, devices[owner])
    for name in ("train_function", "test_function", "predict_function"):
      if getattr(model, name, None) is not None:  # Traced with the old
        setattr(model, name, None)  # variables: Keras' predict went stale.
    self._owner_of = {id(v): o for v, o in zip(weights, owners)}
    self.owners = {v.path: devices[o] for v, o in zip(weights, owners)}
    self._paths = tuple(v.path for v in model.weights)
    trainable = model.trainable_variables
    self._copies = (Copies(trainable, self._owner_list(trainable), devices)
                    if stage < 3 else None)
    self.unsplit_output_names = graph_lib.output_names(model)
    self.unsplit_output_shapes = graph_lib.output_shapes(model)
    self.unsplit_input_dtypes = graph_lib.input_dtypes(model)
    self.unsplit_input_keys = graph_lib.input_keys(model)
    self.built = True

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    """A checkpoint sees the unsplit model's own children (its layers and
    weights, not an `unsplit` attribute): a ShardedModel's checkpoint has
    the keys of the plain model's, so either resumes the other (mirrored to
    any stage and back; the copies of stages 1 and 2 are not saved)."""
    if save_type == "checkpoint":
      return _compat.trackable_children(self.unsplit, save_type, **kwargs)
    return super()._trackable_children(save_type, **kwargs)

  @property
  def source_model(self) -> keras.Model:
    """The model sharded (`unsplit`): it holds the weights."""
    return self.unsplit

  def check_source_unchanged(self) -> None:
    """Raises when the model has weights added or removed since it was
    sharded (`enable_lora()` adds LoRA weights): they have no owner, and
    the step failed with a bare `KeyError`.

    Raises:
      ValueError: naming the weights and what to do.
    """
    cloning.check_same_weights(
        self.unsplit, self._paths,
        f"sharded into ShardedModel {self.name!r}",
        "shard it again (ShardedModel(model, devices, stage=...): the model "
        "holds the weights trained so far)")

  def _owner_list(self, variables: Sequence[Any]) -> list[int]:
    return [self._owner_of[id(v)] for v in variables]

  @property
  def devices(self) -> list[str]:
    """The data-parallel devices, replica by replica."""
    return list(self._devices)

  @property
  def data_parallel(self) -> int:
    """`R`, the number of replicas."""
    return len(self._devices)

  def owner_device(self, variable: Any) -> str:
    """The device that owns `variable` (a weight of the model)."""
    return self._devices[self._owner_of[id(variable)]]

  # ------------------------------------------------------------ values

  def _weights_on(self, r: int, training: bool) -> list[tf.Tensor]:
    """Replica `r`'s values of the trainable weights, on its device: its
    copies (stages 1 and 2, in training), else the owners' variables read
    across devices."""
    owned = self.unsplit.trainable_variables
    row = (self._copies.table[r] if (self._copies and training)
           else [None] * len(owned))
    values = [read_on_owner(v if c is None else c) for v, c in zip(owned, row)]
    with tf.device(self._devices[r]):
      return [tf.identity(v) for v in values]

  def _state_on(self, r: int) -> list[tf.Tensor]:
    """The non-trainable weights (batch-norm statistics, seeds), read from
    their owners onto replica `r`'s device."""
    values = [read_on_owner(v) for v in self.unsplit.non_trainable_variables]
    with tf.device(self._devices[r]):
      return [tf.identity(v) for v in values]

  def _keep_mean_state(self, states: Sequence[Sequence[tf.Tensor]]) -> None:
    """Each non-trainable weight takes the mean of the replicas' new values
    (integers, e.g. seed states: the first replica's), on its owner."""
    for j, v in enumerate(self.unsplit.non_trainable_variables):
      with tf.device(self.owner_device(v)):
        values = [s[j] for s in states]
        new = (tf.add_n(values) / len(values) if values[0].dtype.is_floating
               else values[0])
        v.assign(tf.cast(new, v.dtype))

  # ------------------------------------------------------------ forward

  def _check_rows(self, x) -> list[Any]:
    """A batch splits into `R` near-equal parts, one per replica, weighted
    by their rows (a dataset's short last batch trains as `fit` trains
    it); one of fewer rows than `R` is refused (`microbatch.check_rows`)."""
    r = self.data_parallel
    return microbatch.check_rows(x, r, (
        f"has fewer rows than data_parallel={r} replicas, so some replicas "
        f"would get none. Use batches of at least {r} rows (with a "
        "dataset's short last batch: drop_remainder=True)."))

  def call(self, inputs, training=None):
    """Splits the batch over the replicas (padding it outside training);
    each replica's forward on its device reads the owners' weights."""
    r = self.data_parallel
    x = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    first = tf.nest.flatten(x)[0]
    n = tf.shape(first)[0]
    pad = (-n) % r
    x = tf.nest.map_structure(
        lambda t: tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)), x)
    outs = []
    for i, part in enumerate(microbatch.split(x, r)):
      with tf.device(self._devices[i]), tf.name_scope(f"replica_{i}"):
        y, _ = _compat.stateless_call(
            self.unsplit, self._weights_on(i, False), self._state_on(i), part,
            training=bool(training))
      outs.append(y)
    return microbatch.head(microbatch.concat(outs), n)

  # ------------------------------------------------------------ training

  def _replica_backward(self, r: int, x, y, loss_fn: placed.LossFn,
                        scale) -> tuple[Any, Any, list[Any], list[Any]]:
    """Replica `r`'s forward and backward on its device: `(objective,
    predictions, gradients, new non-trainable values)`."""
    with tf.device(self._devices[r]), tf.name_scope(f"replica_{r}"):
      weights = self._weights_on(r, True)
      with tf.GradientTape() as tape:
        tape.watch(weights)
        y_pred, state, losses = _compat.stateless_call(
            self.unsplit, weights, self._state_on(r), x, return_losses=True,
            training=True)
        total = loss_fn(y, y_pred)
        if len(losses) > self._activity_losses and self.data_parallel > 1:
          # Added in a stateless call, they are on no layer: unnamed.
          microbatch.say_call_losses(
              self.name, [f"of {self.unsplit.name!r}"],
              f"each of the {self.data_parallel} replicas' rows")
        if losses:
          total += scale(tf.add_n([tf.cast(tf.reduce_sum(l), total.dtype)
                                   for l in losses]))
      grads = tape.gradient(total, weights)
    return total, y_pred, grads, state

  def compute_loss_and_gradients(self, x, y, loss_fn: placed.LossFn, *,
                                 scale_regularization=None,
                                 loss_reduction: str = "sum"):
    """Each replica's forward and backward on its slice; gradients not
    summed (`reduce_gradients` sums them on their owners).

    Args:
      x, y: the whole batch, of at least `data_parallel` rows (split into
        near-equal parts, each weighted by its rows).
      loss_fn: `loss_fn(y_true, y_pred)`. `"sum"`: it divides by the global
        batch size (tfmgpu's Trainer), so the replicas' losses add up;
        `"mean"`: it averages the rows it gets (Keras `fit`), so each
        replica's share is divided by `R`.
      scale_regularization: applied to each replica's regularisation, which
        is also divided by `R` (counted once per step, not per replica).

    Returns:
      `(loss, y_pred, grads)`: the summed objective, the replicas' outputs
      in batch order, and each replica's gradient per trainable variable,
      replica by replica (`R * n` entries).
    """
    if loss_reduction not in ("sum", "mean"):
      raise ValueError(f"loss_reduction={loss_reduction!r} must be 'sum' or "
                       "'mean'.")
    r = self.data_parallel
    base = scale_regularization or (lambda t: t)
    with tf.control_dependencies(self._check_rows(x)):
      x = tf.nest.map_structure(tf.identity, x)
    if self._copies is not None:
      with tf.name_scope("zero_all_gather"):
        self._copies.gather(self.unsplit.trainable_variables)
    totals, preds, grads, states = [], [], [], []
    parts = zip(microbatch.split(x, r, uneven=True),
                microbatch.split(y, r, uneven=True),
                microbatch.part_divisors(x, r))
    for i, (xi, yi, d) in enumerate(parts):
      # A mean's share: the replica's rows over the batch's (1/R if equal).
      share = loss_fn if loss_reduction == "sum" else (
          lambda y_true, y_pred, d=d: microbatch.divide(
              loss_fn(y_true, y_pred), d))
      total, y_pred, g, state = self._replica_backward(
          i, xi, yi, share, lambda t, d=d: microbatch.divide(base(t), d))
      totals.append(total)
      preds.append(y_pred)
      grads.extend(g)
      states.append(state)
    if self.unsplit.non_trainable_variables:
      self._keep_mean_state(states)
    return tf.add_n(totals), microbatch.concat(preds), grads

  def _fit_loss_options(self) -> dict[str, Any]:
    """`fit`'s compiled loss averages the rows it gets: shares are `1/R`."""
    return replicated.ReplicatedModel._fit_loss_options(self)  # pylint: disable=protected-access

  def reduce_gradients(self, grads: Sequence[Any],
                       options: allreduce_lib.AllReduceOptions | None = None
                       ) -> list[Any]:
    """Sums each variable's gradients on its owner (a reduce-scatter), then
    clips them to one global norm over every owner's shard.

    Args:
      grads: `R * n` gradients, replica by replica, as
        `compute_loss_and_gradients` returns them.
      options: compression and clipping, as for tfmgpu's data-parallel
        all-reduce (`bytes_per_pack` does not apply). Defaults to none.

    Returns:
      One gradient per trainable variable, on its owner's device.
    """
    options = options or allreduce_lib.AllReduceOptions()
    variables = self.unsplit.trainable_variables
    r, n = self.data_parallel, len(variables)
    if len(grads) != r * n:
      raise ValueError(f"reduce_gradients got {len(grads)} gradients; "
                       f"expected {r} replicas x {n} variables.")
    summed = []
    with tf.name_scope("zero_reduce_scatter"):
      for j, v in enumerate(variables):
        parts = [grads[i * n + j] for i in range(r)]
        if any(p is None for p in parts):
          summed.append(None)
          continue
        summed.append(replicated.sum_on_device(
            parts, self._devices, self.owner_device(v), options.compression))
    present = [g for g in summed if g is not None]
    if options.clip_norm is not None and present:
      it = iter(options.clip(present))  # In unscaled units.
      summed = [None if g is None else next(it) for g in summed]
    return summed

  # ------------------------------------------------------------ weights

  def live_bytes(self, optimizer: keras.optimizers.Optimizer | None = None
                 ) -> dict[str, dict[str, int]]:
    """`{device: {"weights": bytes, "slots": bytes}}`, read from where each
    variable lives: the owners' weights, the copies (stages 1 and 2) and
    the optimizer's slots (its step counter and learning rate left out)."""
    weights = list(self.unsplit.weights)
    if self._copies is not None:
      weights += [c for row in self._copies.table for c in row
                  if c is not None]
    slots = [] if optimizer is None else optimizer_slots(optimizer)
    held = {"weights": bytes_by_device(weights),
            "slots": bytes_by_device(slots)}
    return {device_name(d): {k: held[k].get(device_name(d), 0) for k in held}
            for d in self._devices}

  def load_from(self, unsplit: keras.Model) -> None:
    """Copies the unsplit model's weights into the owners' variables (and
    its layers' seed states: dropout continues where the unsplit's
    stopped, as `cloning.UnsplitWeights.load_from`)."""
    layer_state.set_weights(self.unsplit, unsplit.get_weights())
    cloning.copy_seed_states(cloning.seeded_layers([unsplit]),
                             cloning.seeded_layers([self.unsplit]))

  def copy_weights_to(self, unsplit: keras.Model) -> None:
    """Copies the weights into an unsplit model (and the layers' seed
    states: its dropout continues where this model's stopped)."""
    layer_state.set_weights(unsplit, self.unsplit.get_weights())
    cloning.copy_seed_states(cloning.seeded_layers([self.unsplit]),
                             cloning.seeded_layers([unsplit]))

  def to_unsplit(self, **kwargs) -> keras.Model:
    """The unsplit model, which holds the weights (on their owners)."""
    del kwargs  # Nothing to rebuild: it is the model itself.
    return self.unsplit

  def weighted_layers(self) -> dict[str, Any]:
    """`{name: layer}` of the unsplit model's layers with weights, nested
    models looked into as every layout does (`layer_state.weighted_layers`:
    by top-level layers only, a ZeRO checkpoint of a keras_hub model
    restored into no other layout)."""
    return layer_state.weighted_layers(self.unsplit)
