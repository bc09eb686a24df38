"""`Dense` split over devices (Megatron-LM's column and row layers).

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

An MLP `column -> row` thus costs one sum on `devices[0]` forward, and one
sum of the input's gradients backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu.parallel import activations
from tfmgpu.parallel.on_device import on_device
from tfmgpu.parallel.shards import ShardedLayer
from tfmgpu.parallel.shards import sliced_initializer
from tfmgpu.parallel.shards import split_size


def _dense_config(layer: ShardedLayer) -> dict[str, Any]:
  return {"units": layer.units,
          "activation": keras.activations.serialize(layer.activation),
          "use_bias": layer.use_bias,
          "kernel_initializer": keras.initializers.serialize(
              layer.kernel_initializer),
          "bias_initializer": keras.initializers.serialize(
              layer.bias_initializer)}


@keras.saving.register_keras_serializable(package="tfmgpu")
class ColumnParallelDense(ShardedLayer):
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
    self.supports_masking = True  # As Dense: the output keeps the mask.
    self.units = int(units)
    self.shard_units = split_size(self.units, len(self.devices),
                                    f"layer {self.name!r} units")
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.gather_output = bool(gather_output)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, input_shape):
    T, d = len(self.devices), int(input_shape[-1])
    self._local_activation(len(input_shape))  # Refuses what cannot split.
    kernels = sliced_initializer(self.kernel_initializer, (d, self.units),
                                  1, T, self.variable_dtype)
    biases = sliced_initializer(self.bias_initializer, (self.units,), 0, T,
                                 self.variable_dtype)
    self.kernels, self.biases = [], []
    for t in range(T):
      self.kernels.append(self._add_shard_weight(
          t, f"kernel_{t}", (d, self.shard_units), kernels[t]))
      if self.use_bias:
        self.biases.append(self._add_shard_weight(
            t, f"bias_{t}", (self.shard_units,), biases[t]))

  def _local_activation(self, rank: int) -> bool:
    """Whether each shard applies the activation to its columns (an
    element-wise one); any other (softmax) is applied after the gather.

    Raises:
      ValueError: a non-element-wise activation with `gather_output=False`
        (no shard sees the whole output).
    """
    if self.activation is None:
      return False
    local = activations.acts_elementwise(self.activation, rank, -1)
    if not local and not self.gather_output:
      raise ValueError(
          f"ColumnParallelDense {self.name!r}: activation="
          f"{getattr(self.activation, '__name__', self.activation)!r} "
          "reads the whole output, which gather_output=False leaves split. "
          "Use gather_output=True or an element-wise activation.")
    return local

  def _shard(self, t: int, x):
    y = keras.ops.matmul(x, keras.ops.cast(self.kernels[t], x.dtype))
    if self.use_bias:
      y = keras.ops.add(y, keras.ops.cast(self.biases[t], y.dtype))
    return self.activation(y) if self._local_activation(len(y.shape)) else y

  def _gather(self, *parts):
    y = keras.ops.concatenate(parts, axis=-1)
    if self.activation is None or self._local_activation(len(y.shape)):
      return y
    return self.activation(y)

  def call(self, inputs):
    parts = [on_device(d, lambda x, t=t: self._shard(t, x), inputs,
                       name=f"{self.name}_shard{t}")
             for t, d in enumerate(self.devices)]
    if not self.gather_output:
      return parts
    return on_device(self.devices[0], self._gather, *parts,
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
class RowParallelDense(ShardedLayer):
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
    self.supports_masking = True  # As Dense: the output keeps the mask.
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
    self.shard_rows = split_size(d, T, f"layer {self.name!r} input dim")
    kernels = sliced_initializer(self.kernel_initializer, (d, self.units),
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
