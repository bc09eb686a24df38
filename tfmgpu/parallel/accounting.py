"""Accounting for a hybrid layout: memory, bytes sent and a predicted step.

A layout of `R` data-parallel replicas of `K` stages whose split layers are
sharded over `T` devices (`tfmgpu.parallel.hybrid`, mesh order
`r * (K * T) + k * T + t`), trained on a global batch of `B` examples in `M`
micro-batches per replica (`b = B / R` examples per replica), is costed per
device from the model's layer costs (`tfmgpu.parallel.cost`), the stage plan
(`tfmgpu.parallel.plan.StagePlan`) and the tensor rules
(`tfmgpu.parallel.choices.TENSOR_RULES_GPT` by default):

* which layers split: those a rule names (attention by heads, a Dense by
  columns or by rows). A split layer's weights, gradients, optimizer slots,
  FLOPs and kept activations are divided by `T`, except what stays whole on
  the group's first device: a row layer's bias and attention's output bias
  (added after the sum), and the summed outputs of row and attention layers
  (their activations there). Every other layer runs once, on the group's
  first device, which thus holds the most;
* memory per device: `StagePlan.memory_estimate` of the stages so divided
  (per micro-batch in flight, GPipe or 1F1B, with or without recomputation),
  on `b` examples per step;
* bytes each device sends per step, by kind:
  - data: a ring all-reduce of its gradients over the `R` replicas,
    `2 (R - 1) / R * gradient bytes`;
  - pipeline: the tensors crossing its stage's cut forward, and the
    gradients of what it received backward, for each of the `b` examples;
  - tensor: per split block (an attention layer, or a column layer feeding
    a row layer alone: the Megatron-LM MLP), a forward all-reduce of the
    block's output and a backward all-reduce of its input's gradient (and
    the forward one again when recomputing), each
    `2 (T - 1) / T * bytes`, for each of the `b` examples; a split layer
    outside such a pair is a block of its own;
* a predicted step on a `Hardware` (e.g. a named GPU host, `host_hardware`):
  each stage's forward and backward per micro-batch at the device's FLOP/s
  (split FLOPs divided by `T`; a backward costs `BACKWARD_FACTOR` forwards,
  recomputation one more; each adds `task_overhead_s`), the tensor
  all-reduces added to them over the tensor group's link, the pipeline run
  through `tfmgpu.parallel.timeline.simulate` (its bubble) with the largest
  cut's transfer as every transfer's delay over the pipeline's link, then
  the data all-reduce over the replicas' link, not overlapped. A group that
  spans more devices than one host holds talks over the network.

Not counted: the copy of a split layer's input each shard receives,
framework workspace, allocator fragmentation, overlap of communication with
compute. These are predictions of a cost model, not measurements.

Importing this module does not import TensorFlow; `tensor_split` and
`account` read a Keras model and import it then.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tfmgpu.parallel import choices
from tfmgpu.parallel import links
from tfmgpu.parallel import plan as plan_lib
from tfmgpu.parallel import timeline

# Backward FLOPs per forward FLOP (gradients of inputs and of weights).
BACKWARD_FACTOR = 2.0

_fmt_bytes = plan_lib._fmt_bytes  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The devices a layout is planned or projected for.

  Attributes:
    num_devices: how many devices.
    device_kind: `"GPU"` or `"CPU"` (names the planned devices).
    memory_bytes: the memory budget of each device.
    flops_per_s: sustained training FLOP/s of each device.
    link_bytes_per_s: bandwidth of each device's link inside a host.
    link: the link's name, for the table.
    task_overhead_s: fixed time of each forward or backward a device runs
      (one per micro-batch and stage): launching its kernels, sending its
      tensors. It keeps tiny micro-batches from looking free.
    send_overhead_s: time a device spends on each activation or gradient
      it sends to another stage's device (`timeline.simulate`'s
      `send_time`), on top of the link's delay: interleaved 1F1B sends `V`
      times as often.
    devices_per_host: devices joined by `link`; groups spanning more talk
      over the network. `None`: all devices are in one host.
    network_bytes_per_s: bandwidth per device between hosts (`None`: the
      link's).
    network: the network's name, for the table.
    concurrency: devices' worth of compute the devices share when they
      compute at once (`None`: each computes alone; logical devices of one
      CPU share its cores: `tfmgpu.parallel.calibration` measures it).
  """
  num_devices: int
  device_kind: str
  memory_bytes: int
  flops_per_s: float
  link_bytes_per_s: float
  link: str = ""
  task_overhead_s: float = 0.0
  devices_per_host: int | None = None
  network_bytes_per_s: float | None = None
  network: str = ""
  send_overhead_s: float = 0.0
  concurrency: float | None = None

  def __post_init__(self):
    for name in ("num_devices", "memory_bytes", "flops_per_s",
                 "link_bytes_per_s"):
      value = getattr(self, name)
      if isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0.")
    for name in ("task_overhead_s", "send_overhead_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0.")
    for name in ("devices_per_host", "network_bytes_per_s", "concurrency"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not value > 0):
        raise ValueError(f"{name}={value!r} must be > 0 or None.")

  def devices(self, count: int) -> list[str]:
    return [f"/device:{self.device_kind}:{i}" for i in range(count)]

  def link_for(self, span: int) -> tuple[str, float]:
    """The name and bytes/s of the link a group of `span` consecutive
    devices (from a host's first) talks over."""
    if self.devices_per_host is None or span <= self.devices_per_host:
      return self.link or "link", self.link_bytes_per_s
    return (self.network or "network",
            self.network_bytes_per_s or self.link_bytes_per_s)


def host_hardware(name: str, hosts: int = 1) -> Hardware:
  """The `Hardware` of `hosts` named GPU hosts (`links.GPU_HOSTS`)."""
  h = links.host(name)
  if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
    raise ValueError(f"hosts={hosts!r} must be an int >= 1.")
  return Hardware(h.gpus * hosts, "GPU", int(h.memory_gb * 1e9),
                  h.flops_per_s, h.link_bytes_per_s, h.link,
                  links.TASK_OVERHEAD_S["GPU"], devices_per_host=h.gpus,
                  network_bytes_per_s=h.network_bytes_per_s,
                  network=h.network)


# ------------------------------------------------------ what the rules split


@dataclasses.dataclass(frozen=True)
class SplitLayer:
  """One layer a tensor rule names, and what splitting it divides by `T`.

  Byte and FLOP counts are per example.

  Attributes:
    name: the layer's name.
    kind: `"column"`, `"row"` or `"heads"`.
    sizes: what `T` must divide (units, input dim, or heads).
    param_bytes: bytes of the weights divided over `T` (not the bias that
      stays whole).
    trainable_param_bytes: the trainable ones among them.
    flops: forward FLOPs, divided over `T`.
    activation_bytes: kept activations divided over `T`.
    input_bytes: bytes of its floating-point inputs (a block's backward
      all-reduce, when it starts one).
    output_bytes: bytes of its output (a block's forward all-reduce, when it
      ends one).
    feeds: the row layer this column layer alone feeds (one block), or "".
    why: why no `T` can split it (a rule naming a layer of another type),
      or "".
  """
  name: str
  kind: str
  sizes: tuple[int, ...] = ()
  param_bytes: int = 0
  trainable_param_bytes: int = 0
  flops: int = 0
  activation_bytes: int = 0
  input_bytes: int = 0
  output_bytes: int = 0
  feeds: str = ""
  why: str = ""

  def why_not(self, tensor: int) -> str | None:
    """Why it cannot be split over `tensor` devices, or `None`."""
    if self.why:
      return f"layer {self.name!r}: {self.why}"
    what = {"column": "units", "row": "input dim", "heads": "num_heads"}
    for size in self.sizes:
      if size % tensor:
        return (f"layer {self.name!r}: {what[self.kind]}={size} is not "
                f"divisible by T={tensor}")
    return None


@dataclasses.dataclass(frozen=True)
class StageShare:
  """What the split layers of one stage add up to (per example).

  Attributes:
    param_bytes, trainable_param_bytes, flops, activation_bytes: summed over
      its split layers (`SplitLayer`), before dividing by `T`.
    reduce_forward_bytes: bytes of its blocks' outputs.
    reduce_backward_bytes: bytes of its blocks' inputs.
    blocks: its split blocks (one all-reduce each way).
  """
  param_bytes: int = 0
  trainable_param_bytes: int = 0
  flops: int = 0
  activation_bytes: int = 0
  reduce_forward_bytes: int = 0
  reduce_backward_bytes: int = 0
  blocks: int = 0


@dataclasses.dataclass(frozen=True)
class TensorSplit:
  """The layers of a model that tensor rules split (see `tensor_split`).

  Attributes:
    layers: the rule-matched layers, in topological order.
    rules: the rules, `{regex: kind}`.
  """
  layers: tuple[SplitLayer, ...]
  rules: Mapping[str, str] = dataclasses.field(
      default_factory=lambda: dict(choices.TENSOR_RULES_GPT))

  def why_not(self, tensor: int) -> str | None:
    """Why the model cannot be split over `tensor` devices, or `None`."""
    if tensor == 1:
      return None
    if not self.layers:
      return f"the tensor rules {dict(self.rules)} match no layer"
    for layer in self.layers:
      why = layer.why_not(tensor)
      if why:
        return why
    return None

  def share(self, layer_names: Sequence[str]) -> StageShare:
    """What the split layers among `layer_names` (a stage) add up to; a
    column layer and the row layer it feeds make one block when both are
    in the stage."""
    names = set(layer_names)
    mine = [l for l in self.layers if l.name in names]
    paired = {l.feeds for l in mine if l.feeds in names}
    fwd = sum(l.output_bytes for l in mine if l.feeds not in names)
    bwd = sum(l.input_bytes for l in mine if l.name not in paired)
    return StageShare(
        sum(l.param_bytes for l in mine),
        sum(l.trainable_param_bytes for l in mine),
        sum(l.flops for l in mine), sum(l.activation_bytes for l in mine),
        fwd, bwd, len(mine) - len(paired))


def _rule_for(name: str, rules: Mapping[str, str]) -> str | None:
  for regex, kind in rules.items():
    if re.fullmatch(regex, name):
      return kind
  return None


def _split_layer(node: Any, kind: str, feeds: str, graph: Any) -> SplitLayer:
  """Costs one rule-matched layer call (see `SplitLayer`) of `graph` (a
  `ModelGraph`: its shapes carry the sequence length)."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import cost  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import graph as graph_lib  # pylint: disable=g-import-not-at-top
  layer = node.operation
  want = (keras.layers.MultiHeadAttention if kind == "heads"
          else keras.layers.Dense)
  if type(layer) is not want:  # pylint: disable=unidiomatic-typecheck
    return SplitLayer(layer.name, kind, why=(
        f"a {kind!r} rule splits a {want.__name__}, not a "
        f"{type(layer).__name__}"))
  size = graph_lib.dtype_size(layer.weights[0].dtype) if layer.weights else 4
  out = node.output_tensors[0]
  out_bytes = graph.tensor_bytes(out)
  floats = {id(t): t for t in node.input_tensors
            if "float" in str(t.dtype)}
  kept = cost.node_activation_bytes(node, graph.shape)
  use_bias = bool(getattr(layer, "use_bias", False) or
                  layer.get_config().get("use_bias"))
  if kind == "heads":
    sizes, whole = (layer.num_heads,), int(out.shape[-1]) if use_bias else 0
    kept -= out_bytes  # The summed output lives on the first device.
  elif kind == "column":
    sizes, whole = (layer.units,), 0
  else:
    sizes = (int(node.input_tensors[0].shape[-1]),)
    whole, kept = (layer.units if use_bias else 0), 0
  split = cost.param_bytes(layer) - whole * size
  return SplitLayer(
      layer.name, kind, sizes, split,
      min(split, cost.param_bytes(layer, trainable_only=True)),
      cost.node_flops(node, graph.shape), kept,
      sum(graph.tensor_bytes(t) for t in floats.values()), out_bytes,
      feeds)


def tensor_split(model: Any, rules: Mapping[str, str] | None = None
                 ) -> TensorSplit:
  """The layers of `model` the tensor rules split, costed.

  Args:
    model: a built Keras model (or its `ModelGraph`).
    rules: ordered `{layer name regex: kind}` (the first whose regex fully
      matches applies); defaults to `choices.TENSOR_RULES_GPT`.

  Returns:
    The `TensorSplit` (no layers when no rule matches).
  """
  from tfmgpu.parallel import graph as graph_lib  # pylint: disable=g-import-not-at-top
  rules = dict(choices.TENSOR_RULES_GPT if rules is None else rules)
  graph = (model if isinstance(model, graph_lib.ModelGraph)
           else graph_lib.ModelGraph(model))
  readers: dict[int, list[Any]] = {}
  for node in graph.nodes:
    for t in map(graph.canon, node.input_tensors):
      readers.setdefault(id(t), []).append(node)
  layers = []
  for node in graph.nodes:
    kind = _rule_for(node.operation.name, rules)
    if kind is None:
      continue
    users = readers.get(id(node.output_tensors[0]), [])
    feeds = ""
    if (kind == "column" and len(users) == 1 and
        len(users[0].input_tensors) == 1 and
        _rule_for(users[0].operation.name, rules) == "row"):
      feeds = users[0].operation.name
    layers.append(_split_layer(node, kind, feeds, graph))
  return TensorSplit(tuple(layers), rules)


def path_split(model: Any, axes: Mapping[str, int]) -> TensorSplit:
  """The `TensorSplit` of kernels split by variable path
  (`tfmgpu.parallel.layout_maps`): one entry per split kernel, under the
  name of the layer call (a block) that holds it, with the sums the split
  block runs (`_sums`): an attention split by heads sums its output
  forward and its input's gradient backward once; in a block's MLP the
  row kernel sums its output and each column kernel its input's gradient;
  any other kernel joins its output and its input's gradient.

  Args:
    model: a built Keras model (weight shapes suffice) or its `ModelGraph`.
    axes: `{variable path: axis}`.
  """
  import math  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import block_flops  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import cost  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import graph as graph_lib  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import layer_state  # pylint: disable=g-import-not-at-top
  graph = (model if isinstance(model, graph_lib.ModelGraph)
           else graph_lib.ModelGraph(model))
  layers = []
  for name, node in zip(graph.names, graph.nodes):
    if not graph.first_call(graph.position(name)) or not hasattr(
        node.operation, "weights"):
      continue
    tokens = math.prod(d or 1 for d in graph.shape(node.output_tensors[0])
                       [1:-1]) or 1
    mine = _path_kernels(node.operation, axes)
    # Never more FLOPs than the cost model gives the whole call.
    total = sum(2 * tokens * math.prod(l.kernel.shape) for l in mine)
    scale = min(1.0, cost.node_flops(node, graph.shape) / total) if total \
        else 0.0
    sums = _sums(node.operation, mine, axes)
    for sub in mine:
      kernel = layer_state.variable(sub, "kernel")
      why = layer_state.why_unsplittable(sub)
      if why:  # Never chosen: the build would refuse it.
        layers.append(SplitLayer(name, "column", why=why))
        continue
      shape = tuple(int(d) for d in kernel.shape)
      size = graph_lib.dtype_size(kernel.dtype)
      axis = axes[kernel.path]
      width_in, width_out = block_flops.kernel_widths(sub)
      sends_in, sends_out = sums[id(sub)]
      layers.append(SplitLayer(
          name, "column" if axis else "row", (shape[axis],),
          math.prod(shape) * size,
          math.prod(shape) * size if kernel.trainable else 0,
          int(scale * 2 * tokens * math.prod(shape)), 0,
          tokens * width_in * size * sends_in,
          tokens * width_out * size * sends_out))
  return TensorSplit(tuple(layers), {p: str(a) for p, a in axes.items()})


def _sums(layer: Any, kernels: Sequence[Any], axes: Mapping[str, int]
          ) -> dict[int, tuple[int, int]]:
  """`{id(kernel layer): (sums its input's gradient, sums its output)}`
  (0 or 1 each) inside `layer`, as `split_blocks` splits it: an attention
  split by heads sums once (its query projection's input, its output
  projection's output); an MLP's column kernels feeding its row kernel on
  their shards send only their input's gradient, the row kernel only its
  output."""
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import split_hub_attention  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import layer_state  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import split_kernel  # pylint: disable=g-import-not-at-top
  out = {id(k): (1, 1) for k in kernels}
  for sub in _compat.flatten_layers(layer):
    heads = split_hub_attention.family_of(sub)
    dense = [getattr(sub, n, None) for n in heads.projections] if heads \
        else []
    if any(id(d) in out for d in dense):
      out.update({id(d): (int(i == 0), int(i == 3))
                  for i, d in enumerate(dense)})
  rest = [k for k in kernels if out[id(k)] == (1, 1)]

  def gathers(k):
    _, spec, result = split_kernel.layer_specs(k)
    return spec[axes[layer_state.variable(k, "kernel").path]] in result

  if any(gathers(k) for k in rest) and any(not gathers(k) for k in rest):
    # An MLP: its columns feed its row on their shards.
    out.update({id(k): (1, 0) if gathers(k) else (0, 1) for k in rest})
  return out


def _path_kernels(layer: Any, axes: Mapping[str, int]) -> list[Any]:
  """The layers inside `layer` whose kernel `axes` names."""
  from tfmgpu import _compat  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import layer_state  # pylint: disable=g-import-not-at-top
  return [sub for sub in _compat.flatten_layers(layer)
          if getattr(sub, "kernel", None) is not None
          and layer_state.variable(sub, "kernel").path in axes]


def _split_of(model: Any, rules: Any, tensor: int) -> TensorSplit:
  """The split `account` costs: the rules', or a keras_hub model's own
  (its layout map: `layout_maps.own_axes`) when none or `"layout_map"`."""
  if tensor == 1:
    return TensorSplit(())
  if rules is None or rules == "layout_map":
    from tfmgpu.parallel import layout_maps  # pylint: disable=g-import-not-at-top
    axes = layout_maps.own_axes(model, tensor)
    if axes == {}:  # keras_hub's, with nothing to split: not the GPT rules.
      raise layout_maps.nothing_to_split(model, tensor)
    if axes:
      return path_split(model, axes)
  return tensor_split(model, None if rules == "layout_map" else rules)


# ------------------------------------------------------------ the accounting


@dataclasses.dataclass(frozen=True)
class Sent:
  """Bytes one device sends per step, by kind of parallelism."""
  data: int = 0
  pipeline: int = 0
  tensor: int = 0

  @property
  def total(self) -> int:
    return self.data + self.pipeline + self.tensor


@dataclasses.dataclass(frozen=True)
class DeviceAccount:
  """One device of a layout: where it sits, its memory and what it sends.

  Attributes:
    device: the device's name.
    stage: `k`, its stage.
    shard: `t`, its place in the stage's tensor group (0 runs the unsplit
      layers).
    memory: its `MemoryEstimate`.
    sent: bytes it sends per step.
  """
  device: str
  stage: int
  shard: int
  memory: plan_lib.MemoryEstimate
  sent: Sent


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A predicted step, in seconds: compute (with the pipeline's bubble),
  then what each kind of communication adds, and the link each used."""
  compute_s: float
  tensor_s: float = 0.0
  pipeline_s: float = 0.0
  data_s: float = 0.0
  links: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def comm_s(self) -> float:
    return self.tensor_s + self.pipeline_s + self.data_s

  @property
  def total_s(self) -> float:
    return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class LayoutAccount:
  """A layout's memory and bytes per device, and what predicts its step.

  Made by `account_layout` (or `account`, from a model). Byte and FLOP
  counts per stage are per example.

  Attributes:
    data, stages, tensor: `R`, `K`, `T`.
    micro_batches: `M` per replica (1: the stages one after another).
    schedule: the pipeline's schedule.
    recompute: the backward re-runs each stage's forward.
    global_batch_size: `B`, examples per step over all replicas.
    optimizer: the optimizer whose slots are counted.
    devices: replica 0's `K * T` devices, in mesh order (the other replicas
      hold and send the same).
    stage_flops: forward FLOPs of each stage's first device.
    reduce_bytes: per stage, the bytes its blocks all-reduce forward and
      backward.
    cut_bytes: per stage, the bytes it sends to the next.
    model_name: the model's name.
  """
  data: int
  stages: int
  tensor: int
  micro_batches: int
  schedule: str
  recompute: bool
  global_batch_size: int
  optimizer: str | int
  devices: tuple[DeviceAccount, ...]
  stage_flops: tuple[float, ...]
  reduce_bytes: tuple[tuple[int, int], ...]
  cut_bytes: tuple[int, ...]
  model_name: str = ""
  virtual_stages: int = 1

  @property
  def num_devices(self) -> int:
    return self.data * self.stages * self.tensor

  @property
  def replica_batch(self) -> int:
    return self.global_batch_size // self.data

  @property
  def peak(self) -> DeviceAccount:
    """The device with the most memory (the one that must fit)."""
    return max(self.devices, key=lambda d: d.memory.total)

  @property
  def label(self) -> str:
    """E.g. `data 2 x pipeline K=2 M=4 gpipe x tensor 2`."""
    parts = [f"data {self.data}"] if self.data > 1 else []
    if self.stages > 1 and self.micro_batches > 1:
      parts.append(f"pipeline K={self.stages} M={self.micro_batches} "
                   f"{self.schedule}{' recompute' if self.recompute else ''}")
    elif self.stages > 1:
      parts.append(f"model_parallel K={self.stages}")
    if self.tensor > 1:
      parts.append(f"tensor {self.tensor}")
    return " x ".join(parts) or "one device"

  def step(self, hardware: Hardware) -> StepTime:
    """The predicted step on `hardware` (see the module docstring)."""
    return _step(self, hardware)

  def table(self, hardware: Hardware | str | None = "dgx_a100") -> str:
    """`format_layout_table(self, hardware)`."""
    return format_layout_table(self, hardware)


def _check_sizes(plan: plan_lib.StagePlan, split: TensorSplit, data: int,
                 tensor: int, micro_batches: int, batch: int) -> None:
  for name, value in (("data", data), ("tensor", tensor),
                      ("micro_batches", micro_batches),
                      ("global_batch_size", batch)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be an int >= 1.")
  if batch % (data * micro_batches):
    raise ValueError(
        f"global_batch_size={batch} must divide into data={data} replicas "
        f"x micro_batches={micro_batches} equal micro-batches; pick a batch "
        f"that {data * micro_batches} divides.")
  why = split.why_not(tensor)
  if why:
    raise ValueError(f"The model {plan.model_name!r} cannot be split over "
                     f"tensor={tensor} devices: {why}. Use a T that divides "
                     "the split layers' sizes, or tensor=1.")


def _divided(plan: plan_lib.StagePlan, shares: Sequence[StageShare],
             tensor: int, devices: Sequence[str], shard: int
             ) -> plan_lib.StagePlan:
  """The plan of shard `shard` of every stage: shard 0 holds the unsplit
  layers and `1/T` of the split ones, the others only `1/T` of the split."""
  stages = []
  for s, share in zip(plan.stages, shares):
    part = lambda whole, split: (whole - split if shard == 0 else 0) + (
        split // tensor)
    stages.append(dataclasses.replace(
        s, device=devices[s.index * tensor + shard],
        param_bytes=part(s.param_bytes, share.param_bytes),
        trainable_param_bytes=part(s.trainable_param_bytes,
                                   share.trainable_param_bytes),
        flops=part(s.flops, share.flops),
        activation_bytes=part(s.activation_bytes, share.activation_bytes),
        input_bytes=s.input_bytes if shard == 0 else 0,
        sent_bytes=s.sent_bytes if shard == 0 else 0))
  # A weight shared between stages is never split: it is on shard 0.
  return dataclasses.replace(plan, stages=tuple(stages),
                             shared=plan.shared if shard == 0 else ())


def _ring(n: int, nbytes: float) -> float:
  """Bytes each of `n` devices sends in a ring all-reduce of `nbytes`."""
  return 2 * (n - 1) / n * nbytes


def account_layout(plan: plan_lib.StagePlan, split: TensorSplit, *,
                   global_batch_size: int, data: int = 1, tensor: int = 1,
                   micro_batches: int = 1, schedule: str = "gpipe",
                   recompute: bool = False, optimizer: str | int = "adam",
                   devices: Sequence[str] | None = None,
                   virtual_stages: int = 1) -> LayoutAccount:
  """Memory and bytes per device of a layout (see the module docstring).

  Args:
    plan: the cut into `K` stages (`plan.num_stages`).
    split: what the tensor rules split (`tensor_split`).
    global_batch_size: `B`, examples per step over all replicas.
    data, tensor: `R` and `T`.
    micro_batches: `M` per replica (1: one after another).
    schedule: `"gpipe"` or `"1f1b"`.
    recompute: the backward re-runs each stage's forward.
    optimizer: optimizer name or slots per trainable weight.
    devices: names of replica 0's `K * T` devices in mesh order (default
      `/device:GPU:0`, ...).
    virtual_stages: `V`, interleaved 1F1B: each stage's device runs `V`
      chunks (the step simulates each as `1 / V` of its stage, every chunk
      paying its own task overhead and sends). Memory is counted as plain
      1F1B's.

  Raises:
    ValueError: sizes below 1, a batch that `R * M` does not divide, or a
      `T` the split layers' sizes do not allow (naming the layer).
  """
  _check_sizes(plan, split, data, tensor, micro_batches, global_batch_size)
  K = plan.num_stages
  names = list(devices or [f"/device:GPU:{i}" for i in range(K * tensor)])
  shares = [split.share(s.layers) if tensor > 1 else StageShare()
            for s in plan.stages]
  per_replica = global_batch_size // data
  out = {}
  for shard in range(tensor):
    estimates = _divided(plan, shares, tensor, names, shard).memory_estimate(
        per_replica, optimizer=optimizer, micro_batches=micro_batches,
        schedule=schedule, recompute=recompute)
    for k, (device, memory) in enumerate(estimates.items()):
      cut = plan.stages[k].sent_bytes + (
          plan.stages[k - 1].sent_bytes if k else 0)
      reduce = shares[k].reduce_forward_bytes * (2 if recompute else 1) + (
          shares[k].reduce_backward_bytes)
      sent = Sent(round(_ring(data, memory.gradients)),
                  cut * per_replica if shard == 0 else 0,
                  round(_ring(tensor, reduce * per_replica)))
      out[k * tensor + shard] = DeviceAccount(device, k, shard, memory, sent)
  home = _divided(plan, shares, tensor, names, 0)
  return LayoutAccount(
      data, K, tensor, micro_batches, schedule, recompute,
      global_batch_size, optimizer, tuple(out[i] for i in sorted(out)),
      tuple(float(s.flops) for s in home.stages),
      tuple((sh.reduce_forward_bytes, sh.reduce_backward_bytes)
            for sh in shares),
      tuple(s.sent_bytes for s in plan.stages), plan.model_name,
      virtual_stages)


def _simulate(acc: LayoutAccount, hw: Hardware, fwd: list[float],
              bwd: list[float], delay: float) -> float:
  """The simulated step of per-stage times; with `V` virtual stages each
  stage's work is split into `V` chunks on its device (chunk `c` on device
  `c % K`), each chunk paying `task_overhead_s` again."""
  v, K = acc.virtual_stages, len(fwd)
  if v > 1:
    o = hw.task_overhead_s
    fwd = [(fwd[c % K] - o) / v + o for c in range(K * v)]
    bwd = [(bwd[c % K] - o) / v + o for c in range(K * v)]
  # Shared compute: each stage's device is `data * tensor` devices at once.
  shared = (None if hw.concurrency is None
            else hw.concurrency / (acc.data * acc.tensor))
  return timeline.simulate(
      fwd, bwd, acc.micro_batches, schedule=acc.schedule, virtual_stages=v,
      transfer_time=delay, send_time=hw.send_overhead_s,
      concurrency=shared).step_time


def _step(acc: LayoutAccount, hw: Hardware) -> StepTime:
  """The predicted step of `acc` on `hw` (see the module docstring)."""
  micro = acc.global_batch_size // (acc.data * acc.micro_batches)
  T, K = acc.tensor, acc.stages
  (t_link, t_bw), (p_link, p_bw), (d_link, d_bw) = (
      hw.link_for(T), hw.link_for(K * T), hw.link_for(acc.num_devices))
  extra = BACKWARD_FACTOR + (1 if acc.recompute else 0)
  fwd = [f * micro / hw.flops_per_s + hw.task_overhead_s
         for f in acc.stage_flops]
  bwd = [f * micro / hw.flops_per_s * extra + hw.task_overhead_s
         for f in acc.stage_flops]
  t_fwd = [_ring(T, fb * micro) / t_bw for fb, _ in acc.reduce_bytes]
  t_bwd = [_ring(T, (bb + (fb if acc.recompute else 0)) * micro) / t_bw
           for fb, bb in acc.reduce_bytes]
  run = lambda f, b, delay: _simulate(acc, hw, f, b, delay)
  compute = run(fwd, bwd, 0.0)
  fwd = [a + b for a, b in zip(fwd, t_fwd)]
  bwd = [a + b for a, b in zip(bwd, t_bwd)]
  with_tensor = run(fwd, bwd, 0.0)
  transfer = max(acc.cut_bytes) * micro / p_bw if K > 1 else 0.0
  full = run(fwd, bwd, transfer)
  grads = max(d.memory.gradients for d in acc.devices)
  used = {"tensor": t_link} if T > 1 else {}
  used.update({"pipeline": p_link} if K > 1 else {})
  used.update({"data": d_link} if acc.data > 1 else {})
  return StepTime(compute, with_tensor - compute, full - with_tensor,
                  _ring(acc.data, grads) / d_bw, used)


@dataclasses.dataclass(frozen=True)
class LayoutCosts:
  """What `account` needs of a model for one layout, without the model:
  kept by a placed run to predict its step (`account`)."""
  plan: plan_lib.StagePlan
  split: TensorSplit
  layout: Any
  devices: tuple[str, ...]

  def account(self, *, global_batch_size: int,
              optimizer: str | int = "adam") -> LayoutAccount:
    """`account_layout` of the layout at `global_batch_size`."""
    layout = self.layout
    return account_layout(
        self.plan, self.split, global_batch_size=global_batch_size,
        data=layout.data, tensor=layout.tensor,
        micro_batches=layout.micro_batches or 1, schedule=layout.schedule,
        recompute=layout.recompute, optimizer=optimizer,
        devices=list(self.devices),
        virtual_stages=getattr(layout, "virtual_stages", 1))


def layout_costs(model: Any, layout: Any, *, partition: str = "balanced",
                 rules: Mapping[str, str] | None = None,
                 plan: plan_lib.StagePlan | None = None,
                 devices: Sequence[str] | None = None) -> LayoutCosts:
  """The `LayoutCosts` of `model` in `layout`; arguments as `account`."""
  from tfmgpu.parallel import partition as partition_lib  # pylint: disable=g-import-not-at-top
  K, T = layout.stages, layout.tensor
  V = getattr(layout, "virtual_stages", 1)  # A hybrid.Layout's, or 1.
  names = list(devices or [f"/device:GPU:{i}" for i in range(K * T)])
  if plan is None:
    plan = partition_lib.plan_stages(
        model, K, criterion=partition, devices=names[::T][:K],
        check_devices=False)
  elif plan.num_stages == K * V and V > 1:  # Interleaved chunks: counted
    plan = partition_lib.plan_stages(  # per device, each V chunks' worth.
        model, K, criterion=plan.criterion, devices=names[::T][:K],
        check_devices=False)
  elif plan.num_stages != K:
    raise ValueError(
        f"plan has {plan.num_stages} stages but the layout asks for "
        f"stages={K} (virtual_stages={V}): give a plan of {K} stages (or "
        f"{K * V} interleaved ones), or plan=None.")
  return LayoutCosts(plan, _split_of(model, rules, T), layout, tuple(names))


def account(model: Any, layout: Any, *, global_batch_size: int,
            optimizer: str | int = "adam", partition: str = "balanced",
            rules: Mapping[str, str] | None = None,
            plan: plan_lib.StagePlan | None = None,
            devices: Sequence[str] | None = None) -> LayoutAccount:
  """`account_layout` of a model and a `hybrid.Layout`-like description.

  Args:
    model: a built Keras model (weight shapes suffice:
      `tfmgpu.parallel.graph.shapes_only`).
    layout: has `data`, `stages`, `tensor`, `micro_batches` (`None`: 1),
      `schedule` and `recompute` (e.g. `tfmgpu.parallel.hybrid.Layout`).
    global_batch_size, optimizer: as `account_layout`.
    partition: what the stage cut balances, when `plan` is not given.
    rules: the tensor rules (`choices.TENSOR_RULES_GPT` by default).
    plan: the cut into `layout.stages` stages; made by `plan_stages` when
      `None`. An interleaved plan (`stages * virtual_stages` chunks) is
      counted per device: a `stages` cut, each stage its device's chunks.
    devices: names of replica 0's devices (mesh order).
  """
  return layout_costs(model, layout, partition=partition, rules=rules,
                      plan=plan, devices=devices).account(
                          global_batch_size=global_batch_size,
                          optimizer=optimizer)


def _fmt_time(seconds: float) -> str:
  if seconds >= 1:
    return f"{seconds:.2f} s"
  return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else (
      f"{seconds * 1e6:.3g} us")


def _hardware_for(acc: LayoutAccount, hardware: Hardware | str
                  ) -> tuple[Hardware, str]:
  """`hardware`, or enough of the named host for the layout; its words."""
  if isinstance(hardware, Hardware):
    return hardware, (f"{hardware.num_devices} {hardware.device_kind} "
                      f"device(s), {hardware.flops_per_s / 1e12:.3g} "
                      f"TFLOP/s each, link {hardware.link or '?'} "
                      f"{hardware.link_bytes_per_s / 1e9:.3g} GB/s")
  h = links.host(hardware)
  hosts = math.ceil(acc.num_devices / h.gpus)
  words = (f"{hosts} x {h.name} ({h.gpus} GPUs of {h.memory_gb:g} GB, "
           f"{h.flops_per_s / 1e12:.3g} TFLOP/s sustained each (assumed), "
           f"{h.link} {links.GPU_LINKS[h.link]:g} GB/s inside a host, "
           f"{h.network} {links.NETWORK_GBPS[h.network]:.3g} GB/s per GPU "
           "between hosts)")
  return host_hardware(hardware, hosts), words


def _step_line(acc: LayoutAccount, hardware: Hardware | str) -> str:
  hw, words = _hardware_for(acc, hardware)
  step = acc.step(hw)
  over = lambda kind: f" ({step.links[kind]})" if kind in step.links else ""
  warning = "" if hw.memory_bytes >= acc.peak.memory.total else (
      f" The largest device needs {_fmt_bytes(acc.peak.memory.total)}: "
      f"over the {hw.memory_bytes / 1e9:g} GB of each device.")
  return (f"Projected step on {words}: compute {_fmt_time(step.compute_s)}"
          f" + tensor {_fmt_time(step.tensor_s)}{over('tensor')}"
          f" + pipeline {_fmt_time(step.pipeline_s)}{over('pipeline')}"
          f" + data {_fmt_time(step.data_s)}{over('data')}"
          f" = {_fmt_time(step.total_s)} (predicted by the cost model, not "
          f"measured).{warning}")


def format_layout_table(acc: LayoutAccount,
                        hardware: Hardware | str | None = "dgx_a100") -> str:
  """A layout's accounting as text: per device of replica 0 its weights,
  gradients, optimizer slots, activations and total memory, and the bytes it
  sends per step for data, pipeline and tensor parallelism; the largest;
  then the step projected on `hardware` (a `Hardware`, or a
  `links.GPU_HOSTS` name: as many such hosts as the layout needs; `None`:
  no projection)."""
  header = ("device", "stage", "shard", "weights", "grads", "slots",
            "activations", "total", "sends: data", "pipeline", "tensor")
  fmt = lambda n: _fmt_bytes(n) if n else "-"
  rows = [(d.device, str(d.stage), str(d.shard), _fmt_bytes(d.memory.weights),
           _fmt_bytes(d.memory.gradients),
           _fmt_bytes(d.memory.optimizer_slots),
           _fmt_bytes(d.memory.activations), _fmt_bytes(d.memory.total),
           fmt(d.sent.data), fmt(d.sent.pipeline), fmt(d.sent.tensor))
          for d in acc.devices]
  peak = acc.peak
  rows.append(("max", "", "", "", "", "", "", _fmt_bytes(peak.memory.total),
               fmt(max(d.sent.data for d in acc.devices)),
               fmt(max(d.sent.pipeline for d in acc.devices)),
               fmt(max(d.sent.tensor for d in acc.devices))))
  widths = [max(len(r[i]) for r in [header] + rows)
            for i in range(len(header))]
  line = lambda r: "  ".join([r[0].ljust(widths[0])] + [
      c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip()
  micro = (f"micro-batches of {acc.replica_batch // acc.micro_batches}"
           if acc.micro_batches > 1 else "one micro-batch")
  others = (f"; the other {acc.data - 1} replica(s) alike"
            if acc.data > 1 else "")
  title = (f"Layout {acc.label} of {acc.model_name!r} on "
           f"{acc.num_devices} device(s): batch {acc.global_batch_size} = "
           f"{acc.data} x {acc.replica_batch} per replica, {micro}, "
           f"{acc.optimizer} optimizer slots. Memory and bytes "
           f"sent per step, per device of replica 0{others}:")
  out = [title, line(header)] + [line(r) for r in rows]
  if hardware is not None:
    out.append(_step_line(acc, hardware))
  return "\n".join(out)
