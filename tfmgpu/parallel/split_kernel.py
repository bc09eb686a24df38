"""A `Dense` or `EinsumDense` with its kernel split along one axis.

The layer `split_blocks` puts in place of a kernel a layout map names,
inside a model's blocks (a keras_hub block's MLP; its attention
projections, driven per shard by `split_hub_attention`): shard `t` holds
`1/T` of the kernel on `devices[t]` and computes its part of the product
there (forward and backward, `on_device`). Split along an output axis
(column-parallel), a shard also adds its slice of the bias and applies the
activation (an element-wise one; a softmax is applied after the join), and
the parts are concatenated on `devices[0]` for whoever reads the whole
output; split along a contracted axis (row-parallel), the
parts are summed on `devices[0]`, then the bias (held once) and the
activation. A row kernel reading an elementwise function of column outputs
(an MLP) computes each shard's slice of its input on that shard from the
column parts (`split_mlp`): no join between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from tfmgpu.parallel import activations
from tfmgpu.parallel import split_mlp
from tfmgpu.parallel.on_device import on_device
from tfmgpu.parallel.shards import ShardedLayer
from tfmgpu.parallel.shards import sliced_initializer
from tfmgpu.parallel.shards import split_size

# A Dense's product as an einsum (`layer_specs`); computed as a matmul.
DENSE_EQUATION = "...i,io->...o"


def layer_specs(layer: keras.layers.Layer) -> tuple[str, str, str]:
  """`(input, kernel, output)` einsum specs of a Dense or EinsumDense."""
  if isinstance(layer, keras.layers.EinsumDense):
    ins, out = layer.equation.split("->")
    x, k = ins.split(",")
    return x, k, out
  return "...i", "io", "...o"


def _position(spec: str, letter: str) -> int:
  """The axis of `letter` in an einsum operand spec (negative after a
  `...`)."""
  if "..." in spec:
    tail = spec.split("...")[1]
    if letter in tail:
      return tail.index(letter) - len(tail)
  return spec.index(letter)


def bias_axis_of(layer: keras.layers.Layer, kernel_axis: int) -> int | None:
  """The axis of a Dense / EinsumDense bias that kernel axis `kernel_axis`
  reaches (`None`: no bias, or the axis is contracted or not biased)."""
  if getattr(layer, "bias", None) is None:
    return None
  _, k, out = layer_specs(layer)
  letter = k[kernel_axis]
  if not isinstance(layer, keras.layers.EinsumDense):
    return 0 if letter == "o" else None
  # Keras' bias spans the output from its first biased axis to the end,
  # with size 1 on the axes between that are not biased.
  spans = out[min(out.index(c) for c in layer.bias_axes):]
  return spans.index(letter) if letter in layer.bias_axes else None


@keras.saving.register_keras_serializable(package="tfmgpu")
class SplitKernelDense(ShardedLayer):
  """A `Dense` or `EinsumDense` with its kernel split along one axis.

  Shard `t` (on `devices[t]`) computes `einsum(x_t, kernel_t)`: for an axis
  of the output, its slice of the output (joined by concatenation); for a
  contracted axis, the product of its slice of `x` (joined by a sum). The
  join, the bias (held once, on `devices[0]`) and the activation run on
  `devices[0]`. `get_weights` gives the original layer's (kernel whole);
  `from_config(get_config())` rebuilds an equal layer (weights drawn from
  the initializers, as a Keras layer's).
  """

  def __init__(self, equation: str, kernel_shape: Sequence[int], axis: int,
               devices: Sequence[str], *,
               bias_shape: Sequence[int] | None = None,
               bias_axis: int | None = None,
               activation: Any = None,
               kernel_initializer: Any = "glorot_uniform",
               bias_initializer: Any = "zeros", **kwargs):
    super().__init__(devices, **kwargs)
    self.equation, self.axis = equation, int(axis)
    self.kernel_shape = tuple(int(d) for d in kernel_shape)
    self.bias_shape = (None if bias_shape is None
                       else tuple(int(d) for d in bias_shape))
    # The bias axis split with the kernel's (a head-split projection's bias
    # by heads, each shard adding its own); `None`: held once.
    self.bias_axis = None if bias_axis is None else int(bias_axis)
    x, k, out = (equation.split("->")[0].split(",")
                 + [equation.split("->")[1]])
    letter = k[self.axis]
    self.gathers = letter in out
    self._join_axis = (_position(out, letter) if self.gathers
                       else _position(x, letter))
    self.activation = keras.activations.get(activation)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)
    self._make_weights()

  def _make_weights(self) -> None:
    T = len(self.devices)
    piece = list(self.kernel_shape)
    piece[self.axis] = split_size(piece[self.axis], T,
                                  f"layer {self.name!r} kernel axis "
                                  f"{self.axis}")
    inits = sliced_initializer(self.kernel_initializer, self.kernel_shape,
                               self.axis, T, self.variable_dtype)
    self.kernels = [self._add_shard_weight(t, f"kernel_{t}", piece, inits[t])
                    for t in range(T)]
    self.bias, self.biases = None, []
    if self.bias_shape is not None and self.bias_axis is None:
      self.bias = self._add_shard_weight(0, "bias", self.bias_shape,
                                         self.bias_initializer)
    elif self.bias_shape is not None:
      piece = list(self.bias_shape)
      piece[self.bias_axis] //= T
      inits = sliced_initializer(self.bias_initializer, self.bias_shape,
                                 self.bias_axis, T, self.variable_dtype)
      self.biases = [self._add_shard_weight(t, f"bias_{t}", piece, inits[t])
                     for t in range(T)]
    self.built = True

  def shard_product(self, t: int, x, *, bias: bool = True):
    """Shard `t`'s product for its part `x` of the input (its slice of the
    output, for a kernel split along an output axis), with its slice of
    the bias when the bias is split too (`bias`) and no activation."""
    kernel = keras.ops.cast(self.kernels[t], x.dtype)
    # A Dense's product as Keras' `Dense.call` computes it (`matmul`), not
    # as the einsum `...i,io->...o`: TensorFlow's CPU (oneDNN) einsum with
    # an ellipsis returns wrong float16 values (float16 / mixed_float16).
    y = (keras.ops.matmul(x, kernel) if self.equation == DENSE_EQUATION
         else keras.ops.einsum(self.equation, x, kernel))
    if bias and self.biases:
      y = keras.ops.add(y, keras.ops.cast(self.biases[t], y.dtype))
    return y

  @property
  def local_tail(self) -> bool:
    """Split along an output axis with no bias held whole and an
    element-wise activation (or none): each shard adds its bias slice and
    applies the activation, and the join only concatenates (so its parts
    are the output's slices). A softmax reads the whole output: the join
    applies it."""
    out = self.equation.split("->")[1]
    rank = len(out.replace("...", "")) + ("..." in out)
    return self.gathers and self.bias is None and (
        self.activation is None
        or activations.acts_elementwise(self.activation, rank,
                                          self._join_axis))

  def _shard(self, t: int, x):
    if not self.gathers:
      size = self.kernels[t].shape[self.axis]
      x = keras.ops.take(x, np.arange(t * size, (t + 1) * size),
                         axis=self._join_axis)
    y = self.shard_product(t, x)
    if self.local_tail and self.activation is not None:
      y = self.activation(y)
    return y

  def _join(self, *parts):
    if self.local_tail:
      return keras.ops.concatenate(parts, axis=self._join_axis)
    y = (keras.ops.concatenate(parts, axis=self._join_axis) if self.gathers
         else keras.ops.sum(keras.ops.stack(parts), axis=0))
    if self.bias is not None:
      y = keras.ops.add(y, keras.ops.cast(self.bias, y.dtype))
    return self.activation(y) if self.activation is not None else y

  def _row_parts(self, plan: split_mlp.Plan) -> list[Any]:
    """Each shard's product of its rows with its slice of the input,
    computed there from column outputs' parts (`split_mlp.Plan`)."""
    return [on_device(d, lambda *leaves, t=t: self.shard_product(
        t, plan.run(t, leaves)), *plan.leaves_of(t),
                      name=f"{self.name}_shard{t}")
            for t, d in enumerate(self.devices)]

  def call(self, inputs):
    plan = None if self.gathers else split_mlp.trace(
        inputs, len(self.devices), self._join_axis)
    if plan is not None:
      parts = self._row_parts(plan)
    else:
      parts = [on_device(d, lambda x, t=t: self._shard(t, x), inputs,
                         name=f"{self.name}_shard{t}")
               for t, d in enumerate(self.devices)]
    joined = on_device(self.devices[0], self._join, *parts,
                       name=f"{self.name}_join")
    if self.local_tail:
      split_mlp.mark(joined, parts, self._join_axis)
    return joined

  def compute_output_spec(self, inputs):
    return keras.KerasTensor(
        keras.ops.einsum(self.equation, np.zeros(
            [1 if d is None else d for d in inputs.shape]),
                         np.zeros(self.kernel_shape)).shape,
        self.compute_dtype)

  def _unsplit_layout(self):
    if self.biases:
      return [(self.kernels, self.axis), (self.biases, self.bias_axis)]
    return [(self.kernels, self.axis)] + (
        [] if self.bias is None else [([self.bias], None)])

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(
        equation=self.equation, kernel_shape=list(self.kernel_shape),
        axis=self.axis,
        bias_shape=None if self.bias_shape is None else list(self.bias_shape),
        bias_axis=self.bias_axis,
        activation=keras.activations.serialize(self.activation),
        kernel_initializer=keras.initializers.serialize(
            self.kernel_initializer),
        bias_initializer=keras.initializers.serialize(self.bias_initializer))
    return config
