"""Checkpoints that restore into any layout: weights by layer name, unsplit.

A placed model's variables are its own: a 2-stage pipeline holds each
layer once, a `data 2 x stages 2 x tensor 2` layout holds each weight in
two copies of two shards. A TF checkpoint of one (`model=...`) therefore
restores only into the same layout. Every tfmgpu placement keeps the unsplit
model's layer names and gives each layer's weights in unsplit form
(`weighted_layers()`; a sharded layer's `get_weights` joins its shards), so
a checkpoint also stores this *portable view*: one object per layer name,
its weights as the unsplit layer holds them. `restore_weights` reads it into
any layout of the same model, or into the unsplit model, from a checkpoint
of any layout (and reads a plain model's checkpoint, which has no view,
through the unsplit model).

The view is saved only for models that place themselves; a plain model's
checkpoint is already in unsplit form.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat
from tfmgpu.parallel import layer_state
from tfmgpu.parallel import placed_model

VIEW = "layout_weights"  # The view's name in a tfmgpu checkpoint.


def weighted_layers(model: keras.Model) -> dict[str, Any]:
  """`{layer name: layer}` of a model's layers with weights, unsplit form."""
  own = getattr(model, "weighted_layers", None)
  return own() if own is not None else layer_state.weighted_layers(model)


class _LayerWeights(_compat.Trackable):
  """One layer's weights in unsplit form, as a checkpoint sees them."""

  def __init__(self, layer: Any):
    self._layer = layer
    self.restored = False

  def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
    return {f"weight_{i}": tf.constant(w)
            for i, w in enumerate(self._layer.get_weights())}

  def _restore_from_tensors(self, restored_tensors):
    values = [restored_tensors[f"weight_{i}"]
              for i in range(len(restored_tensors))]
    self.restored = True
    if tf.executing_eagerly():
      layer_state.set_weights(self._layer, [v.numpy() for v in values])
      return tf.no_op()
    # TF restores in a tf.function when the variables are on several hosts
    # (an in-graph run's `ShardedModel`): a layer whose weights are its
    # variables (Keras' own `get_weights`) takes the values by assignment,
    # on the variables' devices.
    weights = self._layer.weights
    if (type(self._layer).get_weights is keras.layers.Layer.get_weights
        and len(weights) == len(values)):
      return tf.group([_compat.variable_storage(w).assign(
          tf.reshape(v, w.shape)) for w, v in zip(weights, values)])
    raise ValueError(
        f"layer {self._layer.name!r} ({type(self._layer).__name__}) splits "
        "its weights itself and cannot take them inside the tf.function TF "
        "restores variables on several hosts with; only models whose "
        "layers keep whole variables (ZeRO's ShardedModel) run across hosts.")


class PortableView(_compat.AutoTrackable):
  """The portable view of a model: a child per layer name."""

  def __init__(self, model: keras.Model):
    self._layers = {name: _LayerWeights(layer)
                    for name, layer in weighted_layers(model).items()}

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    del save_type, kwargs
    return dict(self._layers)

  def missing(self) -> list[str]:
    """Layers a restore did not reach."""
    return [n for n, w in self._layers.items() if not w.restored]


def has_view(path: str) -> bool:
  """The checkpoint at `path` holds a portable view."""
  names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  return any(n.startswith(f"{VIEW}/") for n in names)


def restore_weights(model: keras.Model, path: str) -> keras.Model:
  """Reads the weights of checkpoint `path` into `model`, any layout.

  Args:
    model: the unsplit model or any tfmgpu layout of it (same layer names).
    path: a checkpoint prefix (`MODEL_DIR/checkpoints/ckpt-N`) saved by
      tfmgpu's Trainer in any layout, or a `tf.train.Checkpoint(model=...)`
      of the unsplit model.

  Returns:
    `model`, holding the checkpoint's weights (optimizer state is not read:
    its slots are per layout).

  Raises:
    ValueError: a layer of `model` is missing from the checkpoint (another
      architecture or other layer names).
  """
  if has_view(path):
    view = PortableView(model)
    tf.train.Checkpoint(**{VIEW: view}).read(path).expect_partial()
    missing = view.missing()
  else:  # A plain model's checkpoint: read it through the unsplit model.
    unsplit = placed_model.unsplit_of(model)
    status = tf.train.Checkpoint(model=unsplit).read(path).expect_partial()
    try:
      status.assert_existing_objects_matched()
      missing = []
    except AssertionError as e:
      missing = [str(e).splitlines()[0]]
    if unsplit is not model and not missing:
      model.load_from(unsplit)
  if missing:
    raise ValueError(
        f"Checkpoint {path} does not hold the weights of layers "
        f"{missing[:5]} of model {model.name!r}: it was saved from another "
        "architecture (or other layer names). Restore it into the model it "
        "was trained as.")
  return model
