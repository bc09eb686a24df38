"""What callers may ask of a placed model: the `PlacedModel` protocol.

A placed model (`StagedModel`, `PipelinedModel`, `BranchParallel`,
`TensorParallelModel`, `ReplicatedModel`: every
`tfmgpu.parallel.placed.PerDeviceGradientModel`) routes its own work to its
devices: the Trainer calls its `compute_loss_and_gradients` (each part's
backward on that part's device), serving calls it as is, outside any
data-parallel strategy, and checkpoints also save its weights by layer
name. `is_placed` is the one way to ask "is this a placed model".

A placed model whose layers keep the unsplit model's names also has an
unsplit form (`UnsplitForm`: `to_unsplit`, `copy_weights_to`,
`load_from`); `unsplit_of` gives the model to save, export or restore a
plain checkpoint into, and `source_of` the model it was made from (whose
`compile()` a `Trainer` of the placed model takes). `dtype_policy_of`
gives the dtype policy Keras' `compile` would ask (whether to scale the
loss): a placed model's source's, recorded when it was placed.

Imports neither TensorFlow nor Keras: any layer can ask.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class PlacedModel(Protocol):
  """A Keras model whose parts live on several devices.

  Attributes:
    places_itself: `True`: it routes its own work to its devices.
  """

  places_itself: bool

  def compute_loss_and_gradients(self, x: Any, y: Any,
                                 loss_fn: Callable[[Any, Any], Any], *,
                                 scale_regularization: Any = None
                                 ) -> tuple[Any, Any, list[Any]]:
    """`(loss, y_pred, grads)`, each part's backward on its device."""


@runtime_checkable
class UnsplitForm(Protocol):
  """A placed model that moves its weights to and from the unsplit model."""

  def to_unsplit(self, **kwargs: Any) -> Any:
    """A new unsplit model holding this one's weights."""

  def copy_weights_to(self, unsplit: Any) -> None:
    """Copies this model's weights (and its layers' seed states: a
    Dropout's next masks) into an unsplit model."""

  def load_from(self, unsplit: Any) -> None:
    """Copies an unsplit model's weights (and seed states) into this one."""


@runtime_checkable
class DataCopies(Protocol):
  """A placed model holding data-parallel copies of each weight."""

  def agree_copies(self) -> int:
    """Sets every copy's non-trainable state (BatchNorm's moving
    statistics, which each copy updates from its own rows) to the first
    copy's, the values `to_unsplit` and checkpoints give; returns how many
    variables it set."""


def is_placed(model: Any) -> bool:
  """Whether `model` is a placed model (`PlacedModel`) that says so."""
  return isinstance(model, PlacedModel) and model.places_itself is True


def unsplit_of(model: Any) -> Any:
  """`model.to_unsplit()` for a model with an unsplit form, else `model`."""
  return model.to_unsplit() if isinstance(model, UnsplitForm) else model


def source_of(model: Any) -> Any:
  """The model a placed model was made from (split or sharded), while it
  lives: its `source_model`; `None` for any other model."""
  return getattr(model, "source_model", None) if is_placed(model) else None


def dtype_policy_of(model: Any) -> str | None:
  """The name of the dtype policy Keras' `compile` reads to wrap the
  optimizer in a `LossScaleOptimizer`: a placed model's
  `source_dtype_policy` (its source's, recorded when placed: it holds the
  source only while it lives, and its own policy is the global one it was
  built under), else `model.dtype_policy`'s; `None` without one."""
  recorded = (getattr(model, "source_dtype_policy", None)
              if is_placed(model) else None)
  if recorded is not None:
    return recorded
  return getattr(getattr(model, "dtype_policy", None), "name", None)


def data_copies(model: Any) -> int:
  """How many data-parallel copies of each weight `model` holds: a
  `ReplicatedModel`'s `data_parallel` (each copy's variables are its own,
  updated with the same summed gradients), else 1."""
  return int(getattr(model, "data_parallel", 1) or 1) if is_placed(model) else 1


def agree_copies(model: Any) -> int:
  """`model.agree_copies()` for a placed model with data copies
  (`DataCopies`), so that every copy serves as the model saves; else 0."""
  return (model.agree_copies()
          if is_placed(model) and isinstance(model, DataCopies) else 0)
