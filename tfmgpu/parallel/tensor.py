"""Tensor parallelism: a Keras model rebuilt with its large layers split.

`tensor_parallel(model, devices)` rebuilds a functional model with the layers
its rules name (`GPT_RULES` by default: `tfmgpu.models.gpt`'s attention and
MLP layers; see `tensor_rules`) replaced by split ones (`split_dense`'s
`ColumnParallelDense` / `RowParallelDense`, `split_attention`'s
`HeadParallelAttention`), or, with a `transform`, the kernels inside its
blocks split by variable path (`layout_maps`, `split_blocks`).
`TensorParallelModel` trains it with one tape, each shard's forward and
backward on its device (`on_device`), the rest of the model on
`devices[0]`.

The split layers and rule helpers are importable from here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmgpu import checks
from tfmgpu import devices as devices_lib
from tfmgpu.parallel import cloning
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import placed
from tfmgpu.parallel import shared as shared_lib
from tfmgpu.parallel import tensor_rules
from tfmgpu.parallel.on_device import on_device
from tfmgpu.parallel.shards import ShardedLayer
from tfmgpu.parallel.split_attention import HeadParallelAttention
from tfmgpu.parallel.split_dense import ColumnParallelDense
from tfmgpu.parallel.split_dense import RowParallelDense
from tfmgpu.parallel.tensor_rules import GPT_RULES
from tfmgpu.parallel.tensor_rules import KINDS
from tfmgpu.parallel.tensor_rules import check_rules
from tfmgpu.parallel.tensor_rules import parse_rules
from tfmgpu.parallel.tensor_rules import rule_for

__all__ = ["ColumnParallelDense", "GPT_RULES", "HeadParallelAttention",
           "KINDS", "RowParallelDense", "ShardedLayer", "TensorParallelModel",
           "Transform", "check_rules", "on_device", "parse_rules", "rule_for",
           "tensor_parallel"]


def _scattered(graph: graph_lib.ModelGraph, kinds: Mapping[str, str],
               devices_of: Callable[[str], tuple[str, ...]]) -> set[str]:
  """Column layers whose output stays split: its one reader is a row layer
  on the same devices, and it is not a model output."""
  readers: dict[int, list[Any]] = {}
  for node in graph.nodes:
    for t in map(graph.canon, node.input_tensors):
      readers.setdefault(id(t), []).append(node)
  outputs = {id(t) for t in graph.outputs}
  out = set()
  for node in graph.nodes:
    name = node.operation.name
    if kinds.get(name) != "column" or len(node.output_tensors) != 1:
      continue
    t = node.output_tensors[0]
    users = readers.get(id(t), [])
    if (id(t) not in outputs and len(users) == 1
        and kinds.get(users[0].operation.name) == "row"
        and len(users[0].input_tensors) == 1
        and devices_of(users[0].operation.name) == devices_of(name)):
      out.add(name)
  return out


def _sharded_layer(layer, kind: str, devices: Sequence[str], *,
                   scattered_input: bool, gather: bool) -> ShardedLayer:
  """The split layer replacing `layer` (same name, config and dtype)."""
  layer_state.refuse_split(layer, layer.weights[0].path if layer.weights
                           else layer.name)
  config = layer.get_config()
  common = {"name": layer.name, "dtype": config.get("dtype"),
            "trainable": layer_state.trainable_of(layer),
            "devices": list(devices),
            "kernel_initializer": config["kernel_initializer"],
            "bias_initializer": config["bias_initializer"],
            "use_bias": config["use_bias"]}
  if kind == "heads":
    return HeadParallelAttention(
        config["num_heads"], config["key_dim"],
        value_dim=config.get("value_dim"), dropout=config.get("dropout", 0.0),
        **common)
  dense = {"units": config["units"], "activation": config["activation"]}
  if kind == "column":
    return ColumnParallelDense(gather_output=gather, **dense, **common)
  return RowParallelDense(input_is_parallel=scattered_input, **dense,
                          **common)


# ------------------------------------------------------------ whole models


def _devices_of(devices: Sequence[str] | None,
                devices_for: Callable[[str], Sequence[str]] | None
                ) -> Callable[[str], tuple[str, ...]]:
  """`layer name -> its T devices (canonical)`, from one of the two."""
  if (devices is None) == (devices_for is None):
    raise ValueError("tensor_parallel needs devices=[...] (the T devices of "
                     "every split layer) or devices_for=<layer name -> "
                     "devices>, exactly one of them.")
  if devices is not None:
    if isinstance(devices, str) or not devices:
      raise ValueError(f"devices={devices!r} must be a non-empty list of "
                       "device names, one per shard.")
    fixed = tuple(devices_lib.resolve_devices(devices))
    return lambda name: fixed
  cache: dict[str, tuple[str, ...]] = {}

  def of(name: str) -> tuple[str, ...]:
    if name not in cache:
      got = devices_for(name)
      if isinstance(got, str) or not got:
        raise ValueError(f"devices_for({name!r}) returned {got!r}; it must "
                         "return a non-empty list of device names.")
      cache[name] = tuple(devices_lib.resolve_devices(got))
    return cache[name]

  return of


# `fn(node name, layer, its copy, args, kwargs) -> the layer to call`.
Transform = Callable[..., keras.layers.Layer]


def tensor_parallel(model: keras.Model,
                    devices: Sequence[str] | None = None, *,
                    rules: Mapping[str, str] | None = None,
                    devices_for: Callable[[str], Sequence[str]] | None = None,
                    transform: Transform | None = None) -> keras.Model:
  """`model` rebuilt with the layers `rules` name split over devices.

  The new functional model has the same layer names and graph; each layer
  whose name fully matches a rule (the first that does) is replaced by
  `ColumnParallelDense`, `RowParallelDense` or `HeadParallelAttention`
  (kinds `column`, `row`, `heads`); a column layer read only by a row layer
  on the same devices hands it its pieces without gathering them. The other
  layers are fresh copies, created (and later run) wherever the caller's
  device scope says. Weights are copied from `model`.

  Args:
    model: a built Sequential or functional model (left untouched).
    devices: the `T` devices of every split layer.
    rules: ordered `{regex: kind}`; defaults to `GPT_RULES` (`gpt`'s
      attention and MLP layers). See `parse_rules`.
    devices_for: instead of `devices`, `layer name -> its T devices` (e.g.
      each pipeline stage's layers on that stage's devices).
    transform: `fn(node name, layer, copy, args, kwargs) -> layer to
      call`, applied to each copied (unsplit) layer before it is called on
      `args` and `kwargs`: `tfmgpu.parallel.layout_maps` splits the
      layers inside blocks by variable path so. With it, `rules` may be
      `{}` (no whole layer replaced).

  Returns:
    The split model, holding a copy of `model`'s weights.

  Raises:
    ValueError: both or neither of `devices` and `devices_for`; a device
      that does not exist; a rule matching a layer it cannot split (naming
      the layer, its sizes and `T`); rules matching no layer.
  """
  devices_of = _devices_of(devices, devices_for)
  graph = graph_lib.ModelGraph(model)
  if transform is not None and not rules:
    kinds: dict[str, str] = {}
  else:
    rules = tensor_rules.check_rules(GPT_RULES if rules is None else rules)
    kinds = tensor_rules.split_kinds(graph, rules, devices_of)
  weights = _check_shared(graph, kinds, devices_of)
  clones: dict[str, keras.layers.Layer] = {}
  split = keras.Model(*_replay(graph, kinds, devices_of, clones, transform),
                      name=model.name)
  shared_lib.tie(clones, weights, "tensor-parallel model")
  mine = cloning.weighted_layers([split])
  cloning.copy_weights(cloning.weighted_layers([model]), mine, list(mine),
                       "unsplit")
  cloning.copy_seed_states(cloning.seeded_layers([model]),
                           cloning.seeded_layers([split]))
  return split


def _check_shared(graph: graph_lib.ModelGraph, kinds: Mapping[str, str],
                  devices_of: Callable[[str], tuple[str, ...]]
                  ) -> tuple[shared_lib.SharedWeight, ...]:
  """The weights several layers share; none may be in a layer to split.

  Raises:
    ValueError: a rule splits a layer holding a shared weight (a tied
      embedding): its shards could not stay one weight with the other
      layers' copy. Names the weight, its layers and their devices.
  """
  weights = shared_lib.find_shared(graph.layers())
  for w in weights:
    split = [name for name in w.layers if name in kinds]
    if split:
      where = {name: list(devices_of(name)) if name in kinds else "one device"
               for name in w.layers}
      raise ValueError(
          f"weight {w.path!r} is shared by layers {list(w.layers)} and a "
          f"tensor-parallel rule splits {split} (devices {where}): tfmgpu "
          "cannot split a shared weight exactly. Change the rules so they "
          f"skip {split[0]!r}.")
  return weights


def _replay(graph: graph_lib.ModelGraph, kinds: Mapping[str, str],
            devices_of: Callable[[str], tuple[str, ...]],
            clones: dict[str, keras.layers.Layer],
            transform: Transform | None = None):
  """`(inputs, outputs)` of `graph` replayed with fresh layers, the ones
  in `kinds` split; the fresh copies of the others (after `transform`) go
  in `clones`."""
  scattered = _scattered(graph, kinds, devices_of)
  inputs, tensors = cloning.stage_inputs(graph, 0, 0)
  mine: dict[int, keras.layers.Layer] = {}  # A layer called twice: one copy.
  fresh: dict[int, keras.Model] = {}
  for name, node in zip(graph.names, graph.nodes):
    layer = node.operation
    args, kwargs = node.arguments.fill_in(tensors)
    if id(layer) in mine:
      new = clones[name] = mine[id(layer)]
    elif layer.name in kinds:
      producer = graph_lib._producer(  # pylint: disable=protected-access
          graph.canon(node.input_tensors[0])).operation
      new = _sharded_layer(
          layer, kinds[layer.name], devices_of(layer.name),
          scattered_input=producer.name in scattered,
          gather=layer.name not in scattered)
    else:
      new = cloning.copy_layer(graph, layer, fresh)
      if transform is not None:  # It mirrors the copy's state itself.
        new = transform(name, layer, new, args, kwargs)
      clones[name] = new
    first = id(layer) not in mine
    mine[id(layer)] = new
    outputs = new(*args, **kwargs)
    if (first and transform is None and layer.name not in kinds
        and isinstance(new, keras.layers.Layer)):
      cloning.settle(layer, new)
    if layer.name in scattered:  # One tensor before, its T pieces now.
      tensors[id(node.output_tensors[0])] = outputs
      continue
    for old, value in zip(node.output_tensors, tf.nest.flatten(outputs)):
      tensors[id(old)] = value
  return inputs, tf.nest.map_structure(lambda t: tensors[id(t)],
                                      graph.output_structure)


class TensorParallelModel(cloning.UnsplitWeights,
                          placed.PerDeviceGradientModel):
  """A Keras model whose large layers are split over `T` devices.

  Example:

    model = tfmgpu.models.gpt.gpt((64,), 256, size="mini")
    tp = TensorParallelModel(model, ["/gpu:0", "/gpu:1"])
    tp.compile(optimizer="adam", loss=...)
    tp.fit(x, y)
    tp.copy_weights_to(model)   # serve unsplit

  The split layers (`rules`, default `GPT_RULES`) hold one shard per device
  and run each shard's forward and backward there; the rest of the model
  (embeddings, norms, residual adds, logits, the loss) runs on
  `devices[0]`.

  Attributes:
    devices: the `T` devices, `devices[0]` the home of the rest.
    tensor_parallel: `T`.
    model: the split functional model (same layer names as the unsplit).
  """

  def __init__(self, model: keras.Model, devices: Sequence[str],
               rules: Mapping[str, str] | None = None, *,
               name: str | None = None, transform: Transform | None = None,
               **kwargs):
    """Splits `model` over `devices` and copies its weights.

    Args:
      model: the unsplit, built Sequential or functional model (untouched).
      devices: the `T` devices of every split layer.
      rules: ordered `{regex: kind}`; defaults to `GPT_RULES`.
      name: model name. Defaults to `"<model name>_tensor_parallel"`.
      transform: see `tensor_parallel` (layers split by variable path).
      **kwargs: passed to `keras.Model`.

    Raises:
      ValueError: see `tensor_parallel`.
    """
    checks.refuse_custom_steps(model)
    checks.refuse_stateful_layers(model, "split by TensorParallelModel")
    super().__init__(name=name or f"{model.name}_tensor_parallel", **kwargs)
    if isinstance(devices, str) or not devices:
      raise ValueError(f"devices={devices!r} must be a non-empty list of "
                       "device names, one per shard.")
    self.devices = tuple(devices_lib.resolve_devices(devices))
    self.tensor_parallel = len(self.devices)
    with tf.device(self.devices[0]):
      self.model = tensor_parallel(model, self.devices, rules=rules,
                                   transform=transform)
    self._unsplit_spec = cloning.ModelSpec.of(model)
    self.record_source_policy(model)
    # The unsplit model's output names (a dict's keys) key per-output losses.
    self.unsplit_output_names = graph_lib.output_names(model)
    self.unsplit_output_shapes = graph_lib.output_shapes(model)
    self.unsplit_input_dtypes = graph_lib.input_dtypes(model)
    self.unsplit_input_keys = graph_lib.input_keys(model)
    self.built = True

  def call(self, inputs, training=None):
    with tf.device(self.devices[0]):
      return self.model(inputs, training=training)

  def compute_loss_and_gradients(self, x, y, loss_fn: placed.LossFn, *,
                                 scale_regularization=None):
    """One forward and one tape; each shard's backward on its own device.

    Args:
      x: a batch of inputs, as the unsplit model takes them.
      y: its targets (any structure).
      loss_fn: `loss_fn(y_true, y_pred)` returns the scalar loss to
        differentiate, already averaged and scaled by the caller. Runs on
        `devices[0]`.
      scale_regularization: applied to the summed regularisation losses
        before they join the objective. Defaults to the identity.

    Returns:
      `(loss, y_pred, grads)`: the differentiated objective, the model
      output, one gradient per variable of `self.trainable_variables`.
    """
    scale = scale_regularization or (lambda t: t)
    variables = [v.value for v in self.trainable_variables]
    with tf.device(self.devices[0]), tf.name_scope("tensor_parallel"):
      with tf.GradientTape() as tape:
        y_pred = self.model(x, training=True)
        with tf.name_scope("loss"):
          total = loss_fn(y, y_pred)
        reg = placed.regularization_loss(self.model, scale)
        total = total if reg is None else total + reg
      grads = tape.gradient(total, variables)
    return total, y_pred, grads

  def weighted_layers(self) -> dict[str, Any]:
    """`{name: layer}` of the layers with weights (split layers give their
    weights in unsplit form)."""
    return cloning.weighted_layers([self.model])
