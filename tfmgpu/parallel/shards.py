"""The base of the tensor-parallel layers: weights split into shards.

A `ShardedLayer` holds each shard's variables on that shard's device and
presents them in the unsplit layer's form: `get_weights` returns what the
`Dense` or `MultiHeadAttention` it replaces returns (same order, full
shapes), `set_weights` takes that form and splits it, and a `.keras` file
holds the unsplit form too, so weights move between layouts by layer name
(`StagedModel.load_from`, `copy_weights_to`) and files load into any
layout. Its config keeps its devices, so a clone (`from_config`, as
`StagedModel` rebuilds stages) holds its shards on the same devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf


def split_size(total: int, parts: int, what: str) -> int:
  if total % parts:
    raise ValueError(f"{what}={total} is not divisible by the {parts} "
                     "tensor-parallel devices; pick a device count that "
                     f"divides {total}.")
  return total // parts


def sliced_initializer(initializer: Any, full_shape: Sequence[int],
                        axis: int, parts: int, dtype: Any) -> list[Callable]:
  """`parts` initializers, each the `axis` slice of one draw of the full
  tensor (so a shard has the unsplit layer's initial scale)."""
  full = keras.ops.convert_to_numpy(
      keras.initializers.get(initializer)(tuple(full_shape), dtype=dtype))
  return [lambda shape, dtype=None, piece=piece: tf.constant(piece, dtype)
          for piece in np.split(full, parts, axis=axis)]


class ShardedLayer(keras.layers.Layer):
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

  def save_own_variables(self, store: Any) -> None:
    """Writes the unsplit layer's weights (`get_weights`) to a `.keras` or
    `.weights.h5` store: a file holds no layout."""
    for i, value in enumerate(self.get_weights()):
      store[str(i)] = value

  def load_own_variables(self, store: Any) -> None:
    """Reads what `save_own_variables` wrote and splits it into the shards.

    Raises:
      ValueError: the store holds another number of weights.
    """
    want = len(self._unsplit_layout())
    if len(store.keys()) != want:
      raise ValueError(
          f"layer {self.name!r} ({type(self).__name__}) expects {want} "
          f"weights (the unsplit layer's) in the file, found "
          f"{len(store.keys())}; was it saved from another model?")
    self.set_weights([np.asarray(store[str(i)]) for i in range(want)])

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config["devices"] = list(self.devices)
    return config
