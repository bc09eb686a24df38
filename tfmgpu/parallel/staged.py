"""Device-placed submodel stages: model parallelism with a per-stage backward.

`StagedModel` cuts a Sequential or functional model (one input or several)
along a `StagePlan`. Each stage is a Keras submodel whose variables are
created on its device. Its inputs are the tensors crossing into it: the
model's inputs (as the model takes them: a tensor, list or dict) for stage 0;
for a later stage every tensor made before it and read by it or after it (the
activation, skip tensors, and model inputs such as a mask, which travel with
the activations); its outputs are what crosses out of it (one tensor, or a
list). The forward pass runs each stage under its device, and the backward
pass goes back stage by stage, each under its own device, with its own
`tf.GradientTape`:

    grads_k, grad_in_k = tape_k.gradient(out_k, vars_k + in_k,
                                         output_gradients=grad_in_{k+1})

over the floating-point tensors of `in_k` and `out_k` (integer ones, such as
token ids or a mask, get no gradient). One tape around everything would put
every gradient op on the caller's device. Optimizer slots are created next
to their variables and the optimizer's per-variable update runs on the
variable's device (the `tfmgpu.parallel.placed` base class does that).

From the outside it is a Keras model: `compile`/`fit`/`evaluate`/`predict`,
`save_weights`/`load_weights`. Weights move to and from the unsplit model with
`copy_weights_to`, `load_from` and `to_unsplit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import cloning
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import partition
from tfmgpu.parallel import placed
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import shared as shared_lib


def _build_stage(graph: graph_lib.ModelGraph, start: int, end: int,
                 k: int, name: str,
                 clones: dict[str, keras.layers.Layer] | None = None
                 ) -> keras.Model:
  """Replays nodes `start:end` of `graph` with fresh layers, as a model.

  Its inputs are the tensors crossing into the stage (`cloning.stage_inputs`); its
  outputs the tensors crossing out of it (one, or a list in
  `ModelGraph.crossing` order; tensors that skip the stage pass through),
  and for the last stage the model's outputs as the model returns them.
  Called under the stage's device scope, so the new variables are created
  there. The original model is not touched (no new nodes on its layers).
  Each new layer is recorded in `clones` under its node's name, if given
  (a layer called twice in the stage is copied once).
  """
  inputs, tensors = cloning.stage_inputs(graph, start, k)
  mine: dict[int, keras.layers.Layer] = {}  # A layer called twice: one copy.
  fresh: dict[int, keras.Model] = {}
  for node_name, node in zip(graph.names[start:end], graph.nodes[start:end]):
    args, kwargs = node.arguments.fill_in(tensors)
    clone = mine.get(id(node.operation))
    first = clone is None
    if first:
      clone = mine[id(node.operation)] = cloning.copy_layer(
          graph, node.operation, fresh)
    if clones is not None:
      clones[node_name] = clone
    outputs = clone(*args, **kwargs)
    if first and isinstance(clone, keras.layers.Layer):  # Built now.
      cloning.settle(node.operation, clone)
    for old, new in zip(node.output_tensors, tf.nest.flatten(outputs)):
      tensors[id(old)] = new
  if end == len(graph.nodes):
    out = tf.nest.map_structure(lambda t: tensors[id(t)],
                                graph.output_structure)
  else:
    out = [tensors[id(t)] for t in graph.crossing(end)]
    out = out[0] if len(out) == 1 else out
  return _keeping_own_masks(keras.Model(inputs, out, name=name))


def _no_mask(inputs: Any, previous_mask: Any) -> None:
  del inputs, previous_mask
  return None


def _keeping_own_masks(stage: keras.Model) -> keras.Model:
  """`stage` taking inputs that carry a Keras mask without Keras' warning
  that it "will destroy the mask information" (once per stage and
  micro-batch): its own layers compute its outputs' masks, as in the
  unsplit model (a new user's trial: masks cross stages, the weights equal
  Keras' fit), and it adds none of its own."""
  stage.supports_masking = True
  stage.compute_mask = _no_mask
  return stage


def _check_shared(graph: graph_lib.ModelGraph,
                  weights: Sequence[shared_lib.SharedWeight],
                  stage_of: dict[str, int]) -> None:
  """Refuses what a weight shared between stages cannot do exactly.

  Raises:
    ValueError: a weight shared between stages has a regulariser (each
      stage would add its penalty again), naming the weight and its stages.
  """
  layers = graph.layers()
  for w in weights:
    stages = sorted({stage_of[name] for name in w.layers})
    name, index = w.sites[0]
    regularizer = getattr(layers[name].weights[index], "regularizer", None)
    if len(stages) > 1 and regularizer is not None:
      raise ValueError(
          f"weight {w.path!r} is used on stages {stages} (layers "
          f"{list(w.layers)}) and has a regularizer, which each stage would "
          "count again. Put its layers on one stage (split_points=...) or "
          "drop the regularizer.")


def build_stages(graph: graph_lib.ModelGraph, plan: plan_lib.StagePlan,
                 devices: Sequence[str], name: str
                 ) -> tuple[list[keras.Model], plan_lib.StagePlan]:
  """The stage models of `plan` (stage `k` built on `devices[k]`), with
  every weight the model shares kept one variable, on its first stage.

  Returns:
    `(stages, plan)`: the plan says which weights are shared between which
    stages (`StagePlan.shared`).

  Raises:
    ValueError: a shared weight cannot be kept one (see `_check_shared`).
  """
  weights = shared_lib.find_shared(graph.layers())
  stage_of = {n: s.index for s in plan.stages for n in s.layers}
  across = shared_lib.across_stages(weights, stage_of)
  _check_shared(graph, weights, stage_of)
  stages, clones = [], {}
  for k, stage in enumerate(plan.stages):
    start = graph.position(stage.layers[0])
    with tf.device(devices[k]):
      stages.append(_build_stage(graph, start, start + len(stage.layers), k,
                                 f"{name}_stage_{k}", clones))
  shared_lib.tie(clones, weights, "stage models")
  return stages, dataclasses.replace(plan, shared=across)


def resolve_plan(model: keras.Model, plan: plan_lib.StagePlan | None,
                 num_stages: int | None,
                 plan_kwargs: dict[str, Any]) -> plan_lib.StagePlan:
  """`plan`, or a new plan from `num_stages` and `plan_kwargs` (not both)."""
  if plan is None:
    if num_stages is None:
      num_stages = len(devices_lib.accelerator_devices())
    return partition.plan_stages(model, num_stages, **plan_kwargs)
  if num_stages is not None or plan_kwargs:
    raise ValueError("Pass either plan=... or num_stages/plan options "
                     f"({sorted(plan_kwargs) or ['num_stages']}), not both.")
  return plan


UnsplitWeights = cloning.UnsplitWeights  # Its home before `cloning`.


class StagedModel(UnsplitWeights, placed.PerDeviceGradientModel):
  """A Keras model split into stages, each on its own device.

  Example:

    model = tfmgpu.models.demo.deep_mlp((784,), 10)
    plan = tfmgpu.plan_stages(model, 4)
    staged = tfmgpu.StagedModel.from_model(model, plan)
    staged.compile(optimizer="adam", loss=...)
    staged.fit(x, y)
    staged.copy_weights_to(model)   # serve unsplit

  Attributes:
    plan: the `StagePlan`.
    stages: the stage submodels, `stages[k]` on `plan.devices[k]`.
    stage_devices: the device of each stage.
  """

  def __init__(self, model: keras.Model, plan: plan_lib.StagePlan, *,
               name: str | None = None, unsplit: keras.Model | None = None,
               **kwargs):
    """Builds the stages from `model`'s layers and copies its weights.

    Args:
      model: the unsplit, built Sequential or functional model. It is left
        untouched; stages get new variables on their devices.
      plan: a `StagePlan` for this model (from `plan_stages`).
      name: model name. Defaults to `"<model name>_staged"`.
      unsplit: the model `to_unsplit` rebuilds, when `model` is already a
        rewritten copy of it with the same layer names (e.g. its layers
        split by `tfmgpu.parallel.tensor`). Defaults to `model`.
      **kwargs: passed to `keras.Model`.

    Raises:
      ValueError: the plan does not match the model, or names a device that
        does not exist.
    """
    source = model if unsplit is None else unsplit
    checks.refuse_custom_steps(source)
    checks.refuse_stateful_layers(source, f"split by {type(self).__name__}")
    super().__init__(name=name or f"{model.name}_staged", **kwargs)
    if not isinstance(plan, plan_lib.StagePlan):
      raise TypeError(f"plan={plan!r} is not a StagePlan; make one with "
                      "tfmgpu.plan_stages(model, num_stages).")
    graph = graph_lib.ModelGraph(model)
    if tuple(graph.names) != plan.layer_names:
      raise ValueError(
          f"plan was made for layers {list(plan.layer_names)} but model "
          f"{model.name!r} has {graph.names}. Make the plan from this model.")
    devices = devices_lib.resolve_devices(plan.devices)
    stages, plan = build_stages(graph, plan, devices, model.name)
    self.plan = plan
    self.stage_devices = tuple(devices)
    self.stages = stages
    source = model if unsplit is None else unsplit
    self._unsplit_spec = cloning.ModelSpec.of(source)
    self.record_source_policy(source)
    # The unsplit model's output names key per-output losses and metrics.
    self.unsplit_output_names = graph_lib.output_names(source)
    self.unsplit_output_shapes = graph_lib.output_shapes(source)
    self.unsplit_input_dtypes = graph_lib.input_dtypes(source)
    self.unsplit_input_keys = graph_lib.input_keys(source)
    self.load_from(model)
    self.built = True

  @classmethod
  def from_model(cls, model: keras.Model,
                 plan: plan_lib.StagePlan | None = None, *,
                 num_stages: int | None = None, name: str | None = None,
                 **plan_kwargs) -> "StagedModel":
    """Splits `model` along `plan`, or along `plan_stages(model, num_stages, ...)`.

    Args:
      model: the unsplit, built model.
      plan: a `StagePlan`; if `None`, one is made from `num_stages` and
        `plan_kwargs` (`criterion`, `split_points`, `devices`).
      num_stages: stages to plan when `plan` is `None`. Defaults to the
        number of accelerators.
      name: model name.

    Returns:
      The `StagedModel`, holding a copy of `model`'s weights.
    """
    return cls(model, resolve_plan(model, plan, num_stages, plan_kwargs),
               name=name)

  def call(self, inputs, training=None):
    h = inputs
    for k, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
      with tf.device(device), tf.name_scope(f"stage_{k}"):
        h = stage(h, training=training)
    return h

  def compute_loss_and_gradients(self, x, y, loss_fn: placed.LossFn, *,
                                 scale_regularization=None):
    """Forward stage by stage, then backward stage by stage, each on its device.

    This is the hook a custom training loop (tfmgpu's Trainer) calls;
    `train_step` (what `fit` runs) uses it too.

    Args:
      x: a batch of inputs, as the unsplit model takes them (a tensor, or a
        list or dict of them).
      y: its targets (any structure).
      loss_fn: `loss_fn(y_true, y_pred)` returns the scalar loss to
        differentiate, already averaged and scaled by the caller. It runs on
        the last stage's device.
      scale_regularization: applied to each stage's summed regularisation
        losses (`stage.losses`) before they join that stage's backward, e.g.
        `optimizer.scale_loss`. Defaults to the identity.

    Returns:
      `(loss, y_pred, grads)`: the differentiated objective (`loss_fn` plus
      every stage's scaled regularisation), the model output, and one
      gradient per variable of `self.trainable_variables`, in that order.
    """
    scale = scale_regularization or (lambda t: t)
    records = self._forward_on_tapes(x, y, loss_fn, scale)
    total, grads = self._backward_by_stage(records)
    y_pred = records[-1][2]
    return total, y_pred, [grads.get(id(v)) for v in self.trainable_variables]

  def _forward_on_tapes(self, x, y, loss_fn: placed.LossFn,
                        scale) -> list[tuple[Any, ...]]:
    """Runs each stage under its device and tape; the last adds the loss.

    Returns:
      Per stage `(tape, input, output, objective, sources)`; `input` and
      `output` are structures; `objective` is the stage's scaled
      regularisation (plus the loss on the last stage), or `None`.
    """
    last = len(self.stages) - 1
    records = []
    h = x
    for k, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
      sources = [v.value for v in stage.trainable_variables]
      with tf.device(device), tf.name_scope(f"stage_{k}"):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
          tape.watch(sources)
          if k > 0:
            tape.watch(placed.differentiable(h))
          out = stage(h, training=True)
          objective = placed.regularization_loss(stage, scale)
          if k == last:
            with tf.name_scope("loss"):
              loss = loss_fn(y, out)
            objective = loss if objective is None else loss + objective
      records.append((tape, h, out, objective, sources))
      h = out
    return records

  def _backward_by_stage(self, records: Sequence[tuple[Any, ...]]
                         ) -> tuple[Any, dict[int, Any]]:
    """Differentiates the stages last to first, each on its own device.

    Each stage gets the gradients of the floating-point tensors it sent
    (`placed.differentiable` order) and sends back those of its inputs.

    Returns:
      `(total objective, {id(variable): gradient})`.
    """
    pairs: list[tuple[Any, Any]] = []
    upstream: list[Any] = []
    total = None
    for k in reversed(range(len(records))):
      tape, inp, out, objective, sources = records[k]
      ins = placed.differentiable(inp) if k > 0 else []
      result = placed.backward_on_device(
          tape, self.stage_devices[k], f"stage_{k}_backward",
          outputs=placed.differentiable(out) if upstream else [],
          output_gradients=upstream, objective=objective,
          sources=sources + ins)
      upstream = placed.input_gradients(result[len(sources):], ins,
                                        self.stage_devices[k])
      pairs.extend(zip(self.stages[k].trainable_variables,
                       result[:len(sources)]))
      if objective is not None:
        total = objective if total is None else total + objective
    # A weight shared between stages gets the sum of their gradients.
    return total, shared_lib.sum_by_variable(pairs)

  # ---------------------------------------------------------------- weights

  @property
  def devices(self) -> list[str]:
    """Every device the stages use: each stage's, then its split layers'
    shards (`tfmgpu.parallel.tensor`; inside blocks too, as a keras_hub
    model's layout map splits them), in stage order, each once."""
    found = []
    for stage, device in zip(self.stages, self.stage_devices):
      found.append(device)
      for layer in _compat.flatten_layers(stage)[1:]:
        found.extend(devices_lib.canonical_device(d)
                     for d in getattr(layer, "devices", ()))
    return list(dict.fromkeys(found))

  def weighted_layers(self) -> dict[str, Any]:
    """`{name: layer}` of the stages' layers with weights (layer names are
    the unsplit model's; split layers give their weights in unsplit form)."""
    return cloning.weighted_layers(self.stages)
