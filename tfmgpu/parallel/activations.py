"""Which activations act on each element alone, so that a shard of a
split layer may apply them to its slice of the output (any other, a
softmax, is applied to the joined output)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

# Keras activations that act on each element alone; any other (softmax,
# log_softmax, glu) is probed, as a user's function is.
ELEMENTWISE = frozenset((
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu",
    "silu", "swish", "hard_silu", "hard_swish", "mish", "sigmoid",
    "hard_sigmoid", "tanh", "hard_tanh", "soft_shrink", "hard_shrink",
    "tanh_shrink", "squareplus", "sparse_plus", "softplus", "softsign",
    "exponential", "log_sigmoid", "threshold"))


# `acts_elementwise` answers by `(activation, rank, axis)`.
_ELEMENTWISE_SEEN: dict[Any, bool] = {}


def acts_elementwise(activation: Any, rank: int = 2, axis: int = -1) -> bool:
  """Whether `activation` acts on each element alone along `axis` of a
  `rank`-D output (a shard may apply it to its slice): a Keras one named in
  `ELEMENTWISE`, or a function (keras_hub's `lambda x: gelu(x,
  approximate=True)`) whose slices of a random input's output along `axis`
  are its outputs of the slices. A Keras layer (PReLU) is not probed (that
  would build it): it is applied to the joined output."""
  if getattr(activation, "__name__", None) in ELEMENTWISE:
    return True
  if isinstance(activation, keras.layers.Layer):
    return False
  key = (activation, int(rank), int(axis) % int(rank))
  try:
    return _ELEMENTWISE_SEEN[key]
  except TypeError:  # Unhashable: asked again each time.
    return _probe(activation, *key[1:])
  except KeyError:
    _ELEMENTWISE_SEEN[key] = _probe(activation, *key[1:])
    return _ELEMENTWISE_SEEN[key]


def _probe(activation: Any, rank: int, axis: int) -> bool:
  shape = [3] * rank
  shape[axis] = 8
  x = np.random.default_rng(0).normal(size=shape).astype("float32")
  try:
    with tf.init_scope():  # Eager, also when asked while tracing.
      whole = keras.ops.convert_to_numpy(activation(x))
      parts = [keras.ops.convert_to_numpy(activation(p))
               for p in np.split(x, [3], axis=axis)]
  except Exception:  # pylint: disable=broad-except
    return False
  return whole.shape == x.shape and np.allclose(
      whole, np.concatenate(parts, axis=axis), rtol=1e-6, atol=1e-6)
