"""Dropout's random state in checkpoints: Keras seed generators by layer.

A Keras layer that draws random numbers while training (`Dropout`,
`GaussianNoise`, ...) holds a `SeedGenerator` whose state variable (seed and
counter) advances every step. Keras does not track it for TF checkpoints, so
a checkpoint of the model alone resumes with the state of a new model and
replays the masks of the first steps: the resumed run ends elsewhere than an
uninterrupted one, silently. `SeedStates` puts every generator's state in
the checkpoint, one tensor per layer key (`[n, 2]`: the n generators of the
layers of that key, their name after those of the layers holding them, in
the model's layer order: a layer's own, then each data-parallel copy's), so
that it restores into any layout of the same model: a layout with other
copies takes the states it holds (the first n), and
leaves the rest as they are.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from absl import logging
import keras
import tensorflow as tf

from tfmgpu import _compat

KEY = "seed_generators"  # Their name in a tfmgpu checkpoint.
_ATTRIBUTES = f"{KEY}/.ATTRIBUTES/"  # How a checkpoint's keys spell them.


def by_layer_name(model: keras.Model) -> dict[str, list[Any]]:
  """`{layer key: [seed state variables]}` of every layer of `model`
  (placed models' clones and copies included) that holds seed generators.
  A layer's key is its name after those of the layers (not models) holding
  it, `block_3>dropout`: keras_hub names every block's dropout alike, and
  the models around a block differ by layout (a stage, the backbone)."""
  found: dict[str, list[Any]] = {}
  seen: set[int] = set()

  def visit(layer, held_in: tuple[str, ...]):
    key = held_in + (layer.name,)
    for generator in _compat.own_seed_generators(layer):
      if id(generator.state) not in seen:
        seen.add(id(generator.state))
        found.setdefault(">".join(key), []).append(generator.state)
    inner = held_in if isinstance(layer, keras.Model) else key
    for child in _compat.child_layers(layer):
      visit(child, inner)

  visit(model, ())
  return found


def held_in(names: Collection[str]) -> set[str]:
  """The layer names whose seed states a checkpoint holds, from its
  variable names (`tf.train.list_variables`)."""
  return {n[len(_ATTRIBUTES):] for n in names if n.startswith(_ATTRIBUTES)}


class SeedStates(_compat.Trackable):
  """The seed generators' states of a model, as a checkpoint sees them.

  Args:
    model: the model (plain or placed) whose generators are saved.
    only: restore only these layer names (those a checkpoint holds).
      Defaults to every layer with generators.
  """

  def __init__(self, model: keras.Model, only: Collection[str] | None = None):
    states = by_layer_name(model)
    self._states = {name: v for name, v in states.items()
                    if only is None or name in only}

  def __bool__(self) -> bool:
    return bool(self._states)

  @property
  def layer_names(self) -> list[str]:
    """The layers whose states this object saves or restores."""
    return list(self._states)

  def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
    return {name: tf.stack([tf.convert_to_tensor(_compat.variable_storage(v))
                            for v in states])
            for name, states in self._states.items()}

  def _restore_from_tensors(self, restored_tensors):
    assigns = []
    for name, saved in restored_tensors.items():
      states = self._states[name]
      held = saved.shape[0]  # Unknown inside TF's multi-host tf.function.
      if held is not None and held != len(states):
        logging.info(
            "Seed states of layer %r: the checkpoint holds %d, this layout "
            "%d (other data-parallel copies); the first %d are restored, the "
            "rest keep their own.", name, held, len(states),
            min(held, len(states)))
      assigns += [_compat.variable_storage(state).assign(saved[i])
                  for i, state in enumerate(states[:held])]
    return tf.no_op() if tf.executing_eagerly() else tf.group(assigns)
