"""Forward FLOPs and kept activations inside custom layers: keras_hub's
transformer blocks.

A keras_hub backbone's blocks (`TransformerEncoder`, `TransformerDecoder`,
`LlamaTransformerDecoder`, `GemmaDecoderBlock`, ...) are subclassed layers:
the graph of the model sees one call of each, not the matmuls inside it.
Their cost, per example, for a block called on `(T, D)` positions:

* every `Dense` and `EinsumDense` sublayer, at any depth, applied at each of
  the `T` positions: `2 * kernel elements` per position (a multiply-add per
  weight; plus the bias), which is what their einsums do for the query, key,
  value, output and MLP projections (grouped-query heads included: their
  kernels are smaller);
* each attention (a sublayer named `query`, as keras' `MultiHeadAttention`
  and keras_hub's attentions name it): the scores and the weighted sum,
  `2 * T * T * H` each, where `H = heads * head size` is the query kernel's
  output width (its elements over `D`), and the softmax, 5 per score; a
  causal mask computes them all, as `cost` counts for `MultiHeadAttention`;
* one FLOP per output element for the rest (norms, activations, rotary
  embeddings, residual adds; small beside the matmuls).

What such a block keeps for its backward (`sublayer_activation_elements`):
each `Dense` / `EinsumDense` sublayer's output at every position, and each
attention's scores and their softmax (`2 * heads * T * T`), as `cost`
counts inside `MultiHeadAttention`; norm and activation outputs are not
counted.

A `ReversibleEmbedding` called with `reverse=True` (a keras_hub causal LM's
head: the token embedding's transpose) is a matmul over the vocabulary:
`2 * vocabulary * D` per position. Convolutions inside a custom layer are
not looked into (their shapes are unknown here): such a layer keeps
`cost`'s one FLOP per output element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras

from tfmgpu import _compat

SOFTMAX_FLOPS = 5


def _positions(shape: Sequence[int | None]) -> int:
  return math.prod(1 if d is None else int(d) for d in tuple(shape)[1:-1])


def _kernel(layer: keras.layers.Layer) -> Any:
  if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
    return getattr(layer, "kernel", None)
  return None


def _size(variable: Any) -> int:
  return math.prod(int(d) for d in variable.shape)


def kernel_widths(layer: keras.layers.Layer) -> tuple[int, int]:
  """`(input, output)` elements per position of a `Dense` or `EinsumDense`:
  the kernel's axes its einsum contracts with the input, and those it
  writes to the output (`Dense`: all but the last, and the last)."""
  shape = [int(d) for d in layer.kernel.shape]
  equation = getattr(layer, "equation", None)
  if not equation:
    return math.prod(shape[:-1]), shape[-1]
  operands, output = equation.replace(" ", "").split("->")
  given, kernel = operands.split(",")
  return (math.prod(d for c, d in zip(kernel, shape) if c in given),
          math.prod(d for c, d in zip(kernel, shape) if c in output))


def _heads(kernel: Any, width: int) -> int:
  """The heads of a query kernel: its axis that is neither the input width
  nor the head size (`(D, H, d)` or `(H, D, d)`), else 1."""
  dims = [int(d) for d in kernel.shape]
  if width in dims:
    dims.remove(width)
  return dims[0] if len(dims) == 2 else 1


def sublayer_flops(layer: keras.layers.Layer, in_shape: Sequence[int | None],
                   out_elements: int) -> int | None:
  """Forward FLOPs per example of a custom layer from its sublayers (see the
  module docstring), or `None` when it has no `Dense` / `EinsumDense`
  sublayer (nothing to count here).

  Args:
    layer: the layer called.
    in_shape: its (first) input's shape, batch axis first.
    out_elements: elements per example of its outputs.
  """
  if not isinstance(layer, keras.layers.Layer):  # A bare op (keras.ops).
    return None
  inner = [l for l in _compat.flatten_layers(layer) if l is not layer]
  kernels = [(l, _kernel(l)) for l in inner]
  kernels = [(l, k) for l, k in kernels if k is not None]
  if not kernels:
    return None
  tokens = _positions(in_shape)
  width = int(in_shape[-1]) if in_shape and in_shape[-1] else 1
  flops = out_elements
  for sub, kernel in kernels:
    flops += 2 * tokens * _size(kernel)
    bias = getattr(sub, "bias", None)
    flops += tokens * _size(bias) if bias is not None else 0
    if sub.name == "query":
      flops += tokens * tokens * (
          4 * kernel_widths(sub)[1] +
          SOFTMAX_FLOPS * _heads(kernel, width))
  return flops


def sublayer_activation_elements(layer: keras.layers.Layer,
                                 in_shape: Sequence[int | None]) -> int:
  """Elements per example a custom layer keeps inside it for its backward
  (see the module docstring); 0 without `Dense` / `EinsumDense` sublayers.

  Args:
    layer: the layer called.
    in_shape: its (first) input's shape, batch axis first.
  """
  if not isinstance(layer, keras.layers.Layer):  # A bare op (keras.ops).
    return 0
  tokens = _positions(in_shape)
  width = int(in_shape[-1]) if in_shape and in_shape[-1] else 1
  kept = 0
  for sub in _compat.flatten_layers(layer):
    kernel = _kernel(sub) if sub is not layer else None
    if kernel is None:
      continue
    kept += tokens * kernel_widths(sub)[1]
    if sub.name == "query":
      kept += 2 * _heads(kernel, width) * tokens * tokens
  return kept


def reverse_embedding_flops(node: Any, in_shape: Sequence[int | None]
                            ) -> int | None:
  """FLOPs per example of a `ReversibleEmbedding` called in reverse (the
  logits over its vocabulary), else `None`."""
  layer = node.operation
  if not (isinstance(layer, keras.layers.Embedding) and
          node.arguments.kwargs.get("reverse")):
    return None
  table = getattr(layer, "reverse_embeddings", None)
  if table is None or getattr(layer, "tie_weights", True):
    table = layer.embeddings
  return 2 * _positions(in_shape) * _size(table)
