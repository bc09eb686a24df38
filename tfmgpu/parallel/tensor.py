"""Tensor parallelism: Keras layers split over T devices (Megatron-LM's way).

A transformer's large matrices are split across `T` devices, each device
holding `1/T` of a layer's weights and doing `1/T` of its arithmetic:

* `ColumnParallelDense`: a `Dense` whose kernel (and bias) is split by output
  columns; shard `t` computes `activation(x @ W[:, cols_t] + b[cols_t])` on
  device `t`. Its output stays split (a list of `T` tensors, one per device)
  when its only reader is a `RowParallelDense`, or is gathered (concatenated
  on `devices[0]`).
* `RowParallelDense`: a `Dense` whose kernel is split by input rows; shard
  `t` computes `x[..., rows_t] @ W[rows_t]` on device `t` (from its own piece
  of a split input: no communication after a column layer), and the partial
  products are summed on `devices[0]` (the forward all-reduce), then the
  bias and activation.
* `HeadParallelAttention`: a `keras.layers.MultiHeadAttention` with its heads
  split: shard `t` projects queries, keys and values for its `H/T` heads,
  attends, and multiplies by its rows of the output kernel; the partial
  outputs are summed on `devices[0]` with the output bias.

An MLP `column -> row` and an attention block thus each cost one sum on
`devices[0]` forward, and one sum of the input's gradients backward.

Each shard's variables are created on its device, and its forward AND
backward run there: `on_device` wraps a shard's computation in a
`tf.custom_gradient` whose gradient function runs under the shard's device,
so an outer `tf.GradientTape` (which would put every gradient op on the
caller's device) still computes each shard's backward beside its weights.

The layers present their weights in the unsplit layer's form: `get_weights`
returns what the `Dense` or `MultiHeadAttention` they replace returns (same
order, full shapes), and `set_weights` takes that form and splits it, so
weights move between layouts by layer name (`StagedModel.load_from`,
`copy_weights_to`). Their configs keep their devices, so a clone
(`from_config`, as `StagedModel` rebuilds stages) holds its shards on the
same devices.

`tensor_parallel(model, devices)` rebuilds a functional model with the layers
its rules name (`GPT_RULES` by default: `tfmgpu.models.gpt`'s attention and
MLP layers) replaced by split ones; `TensorParallelModel` trains it with one
tape, the rest of the model on `devices[0]`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmgpu import devices as devices_lib
from tfmgpu.parallel import choices
from tfmgpu.parallel import cloning
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import placed
from tfmgpu.parallel import shared as shared_lib

KINDS = choices.TENSOR_KINDS
GPT_RULES: dict[str, str] = dict(choices.TENSOR_RULES_GPT)

# ------------------------------------------------------------ on one device


def _is_float(t: Any) -> bool:
  return t.dtype.is_floating or t.dtype.is_complex


def on_device(device: str, fn: Callable[..., Any], *inputs: Any,
              name: str = "on_device") -> Any:
  """`fn(*inputs)` with its forward and its backward on `device`.

  The forward runs under `tf.device(device)`, recorded by an inner tape; the
  gradient function (a `tf.custom_gradient`) differentiates that tape under
  `tf.device(device)` too, so the shard's gradient ops stay on its device
  whichever device scope the outer tape's `gradient` call runs under. It
  returns gradients for the floating-point inputs (`None` for integer and
  boolean ones, such as masks) and for every variable `fn` reads. Works
  eagerly and in `tf.function`, under any outer `tf.GradientTape`.

  Args:
    device: where to run.
    fn: takes `inputs` (tensors, or lists of them) and returns a tensor or a
      list of tensors.
    *inputs: tensors or nested structures of tensors (no `None`).
    name: name scope of the forward ops; the backward's is `name +
      "_backward"`.

  Returns:
    What `fn` returns.
  """
  flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]

  @tf.custom_gradient
  def run(*args):
    with tf.device(device), tf.name_scope(name):
      with tf.GradientTape() as tape:
        # Fresh tensors: an input passed twice (attention's query and value)
        # gets the gradient of each use, not the sum of both twice.
        local = [tf.identity(a) if _is_float(a) else a for a in args]
        watched = [a for a in local if _is_float(a)]
        tape.watch(watched)
        out = fn(*tf.nest.pack_sequence_as(inputs, local))
    flat_out = tf.nest.flatten(out)

    def grad_fn(*dys, variables=None):
      variables = list(variables or [])
      with tf.device(device), tf.name_scope(f"{name}_backward"):
        # A `None` seed (an output nobody read) would count as ones.
        seeds = [tf.zeros_like(y) if d is None else d
                 for y, d in zip(flat_out, dys)]
        grads = tape.gradient(flat_out, watched + variables,
                              output_gradients=seeds)
      from_watched = iter(grads[:len(watched)])
      in_grads = [next(from_watched) if _is_float(a) else None for a in args]
      if not variables:
        return in_grads
      return in_grads, grads[len(watched):]

    return out, grad_fn

  with tf.device(device):
    return run(*flat)


# -------------------------------------------------------------- the layers


def _split_sizes(total: int, parts: int, what: str) -> int:
  if total % parts:
    raise ValueError(f"{what}={total} is not divisible by the {parts} "
                     "tensor-parallel devices; pick a device count that "
                     f"divides {total}.")
  return total // parts


def _sliced_initializer(initializer: Any, full_shape: Sequence[int],
                        axis: int, parts: int, dtype: Any) -> list[Callable]:
  """`parts` initializers, each the `axis` slice of one draw of the full
  tensor (so a shard has the unsplit layer's initial scale)."""
  full = keras.ops.convert_to_numpy(
      keras.initializers.get(initializer)(tuple(full_shape), dtype=dtype))
  return [lambda shape, dtype=None, piece=piece: tf.constant(piece, dtype)
          for piece in np.split(full, parts, axis=axis)]


class _ShardedLayer(keras.layers.Layer):
  """The devices, weights in unsplit form, and config shared by the layers.

  A subclass creates its variables in `build` and lists in
  `_unsplit_layout()` how they make the unsplit layer's weights:
  `[(variables, axis), ...]`, in the unsplit layer's `get_weights()` order,
  `axis` being the one the shards are concatenated along (`None` for a
  weight held once).
  """

  def __init__(self, devices: Sequence[str], **kwargs):
    super().__init__(**kwargs)
    devices = [str(d) for d in (devices or [])]
    if not devices:
      raise ValueError(f"{type(self).__name__} {self.name!r} got devices="
                       f"{devices!r}; give one device per shard.")
    self.devices = tuple(devices)

  @property
  def tensor_parallel(self) -> int:
    """The number of shards, `T`."""
    return len(self.devices)

  def _add_shard_weight(self, t: int, name: str, shape: Sequence[int],
                        initializer: Any) -> keras.Variable:
    with tf.device(self.devices[t]):
      return self.add_weight(name=name, shape=tuple(shape),
                             initializer=initializer, trainable=True)

  def _unsplit_layout(self) -> list[tuple[list[Any], int | None]]:
    raise NotImplementedError

  def get_weights(self) -> list[np.ndarray]:
    """The unsplit layer's weights: each the concatenation of its shards."""
    out = []
    for variables, axis in self._unsplit_layout():
      values = [keras.ops.convert_to_numpy(v) for v in variables]
      out.append(values[0] if axis is None else
                 np.concatenate(values, axis=axis))
    return out

  def set_weights(self, weights: Sequence[Any]) -> None:
    """Splits the unsplit layer's weights (`get_weights` form) into the shards.

    Raises:
      ValueError: the wrong number of weights, or a wrong shape.
    """
    layout = self._unsplit_layout()
    want = [w.shape for w in self.get_weights()]
    got = [tuple(np.shape(w)) for w in weights]
    if len(got) != len(layout) or any(tuple(a) != b
                                      for a, b in zip(want, got)):
      raise ValueError(
          f"layer {self.name!r} ({type(self).__name__}) expects "
          f"{len(want)} weights of shapes {[tuple(s) for s in want]} (the "
          f"unsplit layer's), got {len(got)} of shapes {got}.")
    for (variables, axis), value in zip(layout, weights):
      pieces = ([value] if axis is None else
                np.split(np.asarray(value), len(variables), axis=axis))
      for v, piece in zip(variables, pieces):
        v.assign(piece)

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config["devices"] = list(self.devices)
    return config


def _dense_config(layer: _ShardedLayer) -> dict[str, Any]:
  return {"units": layer.units,
          "activation": keras.activations.serialize(layer.activation),
          "use_bias": layer.use_bias,
          "kernel_initializer": keras.initializers.serialize(
              layer.kernel_initializer),
          "bias_initializer": keras.initializers.serialize(
              layer.bias_initializer)}


@keras.saving.register_keras_serializable(package="tfmgpu")
class ColumnParallelDense(_ShardedLayer):
  """`Dense` with its kernel and bias split by output columns over devices.

  Shard `t` (on `devices[t]`) computes `activation(x @ W_t + b_t)` for its
  `units / T` columns. Returns the `T` pieces as a list (each on its device)
  when `gather_output=False` (for a `RowParallelDense` reader), else their
  concatenation on `devices[0]`.
  """

  def __init__(self, units: int, devices: Sequence[str], *,
               activation: Any = None, use_bias: bool = True,
               gather_output: bool = True,
               kernel_initializer: Any = "glorot_uniform",
               bias_initializer: Any = "zeros", **kwargs):
    super().__init__(devices, **kwargs)
    self.units = int(units)
    self.shard_units = _split_sizes(self.units, len(self.devices),
                                    f"layer {self.name!r} units")
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.gather_output = bool(gather_output)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, input_shape):
    T, d = len(self.devices), int(input_shape[-1])
    kernels = _sliced_initializer(self.kernel_initializer, (d, self.units),
                                  1, T, self.variable_dtype)
    biases = _sliced_initializer(self.bias_initializer, (self.units,), 0, T,
                                 self.variable_dtype)
    self.kernels, self.biases = [], []
    for t in range(T):
      self.kernels.append(self._add_shard_weight(
          t, f"kernel_{t}", (d, self.shard_units), kernels[t]))
      if self.use_bias:
        self.biases.append(self._add_shard_weight(
            t, f"bias_{t}", (self.shard_units,), biases[t]))

  def _shard(self, t: int, x):
    y = keras.ops.matmul(x, keras.ops.cast(self.kernels[t], x.dtype))
    if self.use_bias:
      y = keras.ops.add(y, keras.ops.cast(self.biases[t], y.dtype))
    return self.activation(y) if self.activation is not None else y

  def call(self, inputs):
    parts = [on_device(d, lambda x, t=t: self._shard(t, x), inputs,
                       name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    if not self.gather_output:
      return parts
    return on_device(self.devices[0],
                     lambda *p: keras.ops.concatenate(p, axis=-1), *parts,
                     name=f"{self.name}_gather")

  def compute_output_spec(self, inputs):
    shape = tuple(inputs.shape[:-1])
    if self.gather_output:
      return keras.KerasTensor(shape + (self.units,), self.compute_dtype)
    return [keras.KerasTensor(shape + (self.shard_units,), self.compute_dtype)
            for _ in self.devices]

  def _unsplit_layout(self):
    return [(self.kernels, 1)] + ([(self.biases, 0)] if self.use_bias else [])

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(_dense_config(self), gather_output=self.gather_output)
    return config


@keras.saving.register_keras_serializable(package="tfmgpu")
class RowParallelDense(_ShardedLayer):
  """`Dense` with its kernel split by input rows over devices.

  Shard `t` (on `devices[t]`) multiplies its piece of the input by its
  `in / T` rows; the partial products are summed on `devices[0]`, then the
  bias (held once, on `devices[0]`) and the activation apply. The input is
  either the list of `T` pieces a `ColumnParallelDense(gather_output=False)`
  returns (`input_is_parallel=True`), or one full tensor each shard slices.
  """

  def __init__(self, units: int, devices: Sequence[str], *,
               activation: Any = None, use_bias: bool = True,
               input_is_parallel: bool = False,
               kernel_initializer: Any = "glorot_uniform",
               bias_initializer: Any = "zeros", **kwargs):
    super().__init__(devices, **kwargs)
    self.units = int(units)
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.input_is_parallel = bool(input_is_parallel)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, input_shape):
    T = len(self.devices)
    if self.input_is_parallel:
      d = sum(int(s[-1]) for s in input_shape)
    else:
      d = int(input_shape[-1])
    self.shard_rows = _split_sizes(d, T, f"layer {self.name!r} input dim")
    kernels = _sliced_initializer(self.kernel_initializer, (d, self.units),
                                  0, T, self.variable_dtype)
    self.kernels = [self._add_shard_weight(
        t, f"kernel_{t}", (self.shard_rows, self.units), kernels[t])
                    for t in range(T)]
    self.bias = None
    if self.use_bias:
      self.bias = self._add_shard_weight(0, "bias", (self.units,),
                                         self.bias_initializer)

  def _shard(self, t: int, x):
    if not self.input_is_parallel:
      x = x[..., t * self.shard_rows:(t + 1) * self.shard_rows]
    return keras.ops.matmul(x, keras.ops.cast(self.kernels[t], x.dtype))

  def _reduce(self, *parts):
    y = tf.add_n(list(parts))
    if self.use_bias:
      y = keras.ops.add(y, keras.ops.cast(self.bias, y.dtype))
    return self.activation(y) if self.activation is not None else y

  def call(self, inputs):
    if self.input_is_parallel and len(inputs) != len(self.devices):
      raise ValueError(f"layer {self.name!r} got {len(inputs)} input pieces "
                       f"for {len(self.devices)} devices.")
    pieces = inputs if self.input_is_parallel else [inputs] * len(self.devices)
    parts = [on_device(d, lambda x, t=t: self._shard(t, x), pieces[t],
                       name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    return on_device(self.devices[0], self._reduce, *parts,
                     name=f"{self.name}_reduce")

  def compute_output_spec(self, inputs):
    first = inputs[0] if self.input_is_parallel else inputs
    return keras.KerasTensor(tuple(first.shape[:-1]) + (self.units,),
                             self.compute_dtype)

  def _unsplit_layout(self):
    return [(self.kernels, 0)] + ([([self.bias], None)] if self.use_bias
                                  else [])

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(_dense_config(self),
                  input_is_parallel=self.input_is_parallel)
    return config


@keras.saving.register_keras_serializable(package="tfmgpu")
class HeadParallelAttention(_ShardedLayer):
  """`keras.layers.MultiHeadAttention` with its heads split over devices.

  Shard `t` (on `devices[t]`) holds the query, key and value kernels and
  biases of its `num_heads / T` heads and their rows of the output kernel;
  it projects, attends (Keras' `ops.dot_product_attention`, scaled by
  `1/sqrt(key_dim)`, as `MultiHeadAttention` does) and projects out. The
  partial outputs are summed on `devices[0]` with the output bias. Inputs
  of shape `(B, T, d)`; masks as `MultiHeadAttention`'s `attention_mask`
  and `use_causal_mask` (Keras masks of the inputs are not read). No
  dropout.
  """

  def __init__(self, num_heads: int, key_dim: int, devices: Sequence[str],
               *, value_dim: int | None = None, dropout: float = 0.0,
               use_bias: bool = True,
               kernel_initializer: Any = "glorot_uniform",
               bias_initializer: Any = "zeros", **kwargs):
    super().__init__(devices, **kwargs)
    if dropout:
      raise ValueError(
          f"HeadParallelAttention {self.name!r} got dropout={dropout!r}; "
          "split attention does not support dropout. Use dropout=0 (gpt: "
          "the default) or leave this layer unsplit.")
    self.num_heads, self.key_dim = int(num_heads), int(key_dim)
    self.value_dim = int(value_dim) if value_dim else self.key_dim
    self.dropout = 0.0
    self.use_bias = bool(use_bias)
    self.shard_heads = _split_sizes(self.num_heads, len(self.devices),
                                    f"layer {self.name!r} num_heads")
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, query_shape, value_shape, key_shape=None):
    T, H = len(self.devices), self.num_heads
    dq, dv = int(query_shape[-1]), int(value_shape[-1])
    dk = int((key_shape or value_shape)[-1])
    shapes = {"query": ((dq, H, self.key_dim), 1),
              "key": ((dk, H, self.key_dim), 1),
              "value": ((dv, H, self.value_dim), 1),
              "output": ((H, self.value_dim, dq), 0)}
    self.shards = [{} for _ in range(T)]
    for part, (shape, axis) in shapes.items():
      kernels = _sliced_initializer(self.kernel_initializer, shape, axis, T,
                                    self.variable_dtype)
      for t in range(T):
        piece = list(shape)
        piece[axis] //= T
        self.shards[t][f"{part}_kernel"] = self._add_shard_weight(
            t, f"{part}_kernel_{t}", piece, kernels[t])
        if self.use_bias and part != "output":
          self.shards[t][f"{part}_bias"] = self._add_shard_weight(
              t, f"{part}_bias_{t}", piece[1:], self.bias_initializer)
    self.output_bias = None
    if self.use_bias:
      self.output_bias = self._add_shard_weight(0, "output_bias", (dq,),
                                                self.bias_initializer)

  def _project(self, shard: dict[str, Any], part: str, x, equation: str):
    y = keras.ops.einsum(equation, x,
                         keras.ops.cast(shard[f"{part}_kernel"], x.dtype))
    if self.use_bias and part != "output":
      y = keras.ops.add(y, keras.ops.cast(shard[f"{part}_bias"], y.dtype))
    return y

  def _shard(self, t: int, query, key, value, *mask, is_causal: bool):
    shard = self.shards[t]
    q = self._project(shard, "query", query, "abc,cde->abde")
    k = self._project(shard, "key", key, "abc,cde->abde")
    v = self._project(shard, "value", value, "abc,cde->abde")
    out = keras.ops.dot_product_attention(
        q, k, v, mask=mask[0] if mask else None,
        scale=1.0 / math.sqrt(float(self.key_dim)), is_causal=is_causal)
    return self._project(shard, "output", out, "abcd,cde->abe")

  def _reduce(self, *parts):
    y = tf.add_n(list(parts))
    if self.use_bias:
      y = keras.ops.add(y, keras.ops.cast(self.output_bias, y.dtype))
    return y

  def call(self, query, value, key=None, attention_mask=None,
           use_causal_mask=False, training=None):
    del training  # No dropout.
    key = value if key is None else key
    mask = _attention_mask(query, value, attention_mask, use_causal_mask)
    is_causal = bool(use_causal_mask) and attention_mask is None
    extra = [] if mask is None else [mask]
    parts = [on_device(d, lambda q, k, v, *m, t=t: self._shard(
        t, q, k, v, *m, is_causal=is_causal), query, key, value, *extra,
                       name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    return on_device(self.devices[0], self._reduce, *parts,
                     name=f"{self.name}_reduce")

  def compute_output_spec(self, query, value, key=None, attention_mask=None,
                          use_causal_mask=False, training=None):
    del value, key, attention_mask, use_causal_mask, training
    return keras.KerasTensor(tuple(query.shape), self.compute_dtype)

  def _unsplit_layout(self):
    layout = []
    for part in ("query", "key", "value", "output"):
      layout.append(([s[f"{part}_kernel"] for s in self.shards],
                     0 if part == "output" else 1))
      if self.use_bias:
        layout.append(([s[f"{part}_bias"] for s in self.shards], 0)
                      if part != "output" else ([self.output_bias], None))
    return layout

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(
        num_heads=self.num_heads, key_dim=self.key_dim,
        value_dim=self.value_dim, dropout=self.dropout,
        use_bias=self.use_bias,
        kernel_initializer=keras.initializers.serialize(
            self.kernel_initializer),
        bias_initializer=keras.initializers.serialize(self.bias_initializer))
    return config


def _attention_mask(query, value, attention_mask, use_causal_mask):
  """`MultiHeadAttention`'s mask, `(B, 1, T, S)` bool, or `None` when only
  the causal mask applies (then the kernel's `is_causal` does it, as Keras
  does)."""
  if attention_mask is None:
    return None
  mask = keras.ops.cast(attention_mask, "bool")
  if use_causal_mask:
    q_len, v_len = keras.ops.shape(query)[1], keras.ops.shape(value)[1]
    ones = keras.ops.ones((1, q_len, v_len), dtype="int32")
    causal = keras.ops.greater_equal(keras.ops.cumsum(ones, axis=-2),
                                     keras.ops.cumsum(ones, axis=-1))
    mask = keras.ops.logical_and(mask, causal)
  while len(mask.shape) < 4:
    mask = keras.ops.expand_dims(mask, axis=-3)
  return mask


# ------------------------------------------------------------------- rules


def check_rules(rules: Mapping[str, str]) -> dict[str, str]:
  """`rules` as an ordered `{regex: kind}` dict, each regex compiled once.

  Raises:
    ValueError: an unknown kind or a regex that does not compile, naming
      the entry.
  """
  if not isinstance(rules, Mapping) or not rules:
    raise ValueError(f"rules={rules!r} must be a non-empty mapping of layer "
                     f"name regex -> kind ({', '.join(KINDS)}), e.g. "
                     "tfmgpu.parallel.tensor.GPT_RULES.")
  out = {}
  for regex, kind in rules.items():
    if kind not in KINDS:
      raise ValueError(f"rule {regex!r}={kind!r}: unknown kind {kind!r}; "
                       f"choose one of {', '.join(KINDS)}.")
    try:
      re.compile(regex)
    except re.error as e:
      raise ValueError(f"rule {regex!r}={kind!r}: the regex does not "
                       f"compile ({e}).") from e
    out[regex] = kind
  return out


def parse_rules(text: str) -> dict[str, str]:
  """Parses `"regex=kind,regex=kind"` (a flag's value) into ordered rules.

  Each entry splits at its last `=`; entries are separated by commas (so a
  regex cannot hold a comma or end in `=`). Kinds: `column`, `row`,
  `heads`.

  Raises:
    ValueError: an entry without `=`, an empty regex, an unknown kind or a
      regex that does not compile, naming the entry.
  """
  rules = {}
  for entry in (e.strip() for e in str(text).split(",")):
    if not entry:
      continue
    regex, sep, kind = entry.rpartition("=")
    if not sep or not regex.strip():
      raise ValueError(f"tensor-parallel rule {entry!r} must be regex=kind, "
                       f"kind one of {', '.join(KINDS)} (e.g. "
                       "'.*_mlp_up=column,.*_mlp_down=row').")
    rules[regex.strip()] = kind.strip()
  if not rules:
    raise ValueError(f"tensor-parallel rules {text!r} name no rule; give "
                     "regex=kind entries separated by commas.")
  return check_rules(rules)


def rule_for(name: str, rules: Mapping[str, str]) -> str | None:
  """The kind of the first rule whose regex fully matches `name`, or `None`."""
  for regex, kind in rules.items():
    if re.fullmatch(regex, name):
      return kind
  return None


def _cannot_split(layer, kind: str, T: int) -> str | None:
  """Why `layer` cannot be split as `kind` over `T` devices, or `None`."""
  want = (keras.layers.MultiHeadAttention if kind == "heads"
          else keras.layers.Dense)
  if type(layer) is not want:  # pylint: disable=unidiomatic-typecheck
    return f"a {kind!r} rule splits a {want.__name__}, not a " + (
        type(layer).__name__)
  config = layer.get_config()
  extras = [k for k in ("kernel_regularizer", "bias_regularizer",
                        "activity_regularizer", "kernel_constraint",
                        "bias_constraint", "lora_rank", "quantization_config",
                        "sliding_window", "output_shape")
            if config.get(k)]
  if kind == "heads":
    extras += [k for k in ("use_gate", "dropout") if config.get(k)]
    if tuple(config.get("attention_axes") or (1,)) != (1,):
      extras.append("attention_axes")
    if layer.num_heads % T:
      return f"num_heads={layer.num_heads} is not divisible by T={T}"
  elif kind == "column" and layer.units % T:
    return f"units={layer.units} is not divisible by T={T}"
  elif kind == "row" and layer.kernel.shape[0] % T:
    return f"its input dim {layer.kernel.shape[0]} is not divisible by T={T}"
  if extras:
    return f"split layers do not support {', '.join(extras)}"
  return None


def _sizes(layer) -> str:
  if isinstance(layer, keras.layers.MultiHeadAttention):
    return f"num_heads={layer.num_heads}, key_dim={layer.key_dim}"
  if isinstance(layer, keras.layers.Dense) and layer.built:
    return f"input dim {layer.kernel.shape[0]}, units={layer.units}"
  return f"{layer.count_params()} weights" if layer.built else "unbuilt"


def _split_kinds(graph: graph_lib.ModelGraph, rules: Mapping[str, str],
                 devices_of: Callable[[str], tuple[str, ...]]
                 ) -> dict[str, str]:
  """`{layer name: kind}` of the layers to split, each checked."""
  kinds = {}
  for node in graph.nodes:
    layer = node.operation
    kind = rule_for(layer.name, rules)
    if kind is None:
      continue
    T = len(devices_of(layer.name))
    why = _cannot_split(layer, kind, T)
    if why:
      raise ValueError(
          f"layer {layer.name!r} ({type(layer).__name__}, {_sizes(layer)}) "
          f"matches a {kind!r} tensor-parallel rule but cannot be split over "
          f"T={T} devices: {why}. Change the rules so they skip it, or use a "
          "T that divides its sizes.")
    kinds[layer.name] = kind
  if not kinds:
    raise ValueError(
        f"the tensor-parallel rules {dict(rules)} match no layer of model "
        f"{graph.model.name!r} (layers: {graph.names}); nothing would be "
        "split. Give rules whose regexes fully match layer names.")
  return kinds


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
                   scattered_input: bool, gather: bool) -> _ShardedLayer:
  """The split layer replacing `layer` (same name, config and dtype)."""
  config = layer.get_config()
  common = {"name": layer.name, "dtype": config.get("dtype"),
            "trainable": layer.trainable, "devices": list(devices),
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
    rules = check_rules(GPT_RULES if rules is None else rules)
    kinds = _split_kinds(graph, rules, devices_of)
  weights = _check_shared(graph, kinds, devices_of)
  clones: dict[str, keras.layers.Layer] = {}
  split = keras.Model(*_replay(graph, kinds, devices_of, clones, transform),
                      name=model.name)
  shared_lib.tie(clones, weights, "tensor-parallel model")
  mine = cloning.weighted_layers([split])
  cloning.copy_weights(cloning.weighted_layers([model]), mine, list(mine),
                       "unsplit")
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
      if transform is not None:
        new = transform(name, layer, new, args, kwargs)
      clones[name] = new
    mine[id(layer)] = new
    outputs = new(*args, **kwargs)
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
    # The unsplit model's output names (a dict's keys) key per-output losses.
    self.unsplit_output_names = graph_lib.output_names(model)
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
