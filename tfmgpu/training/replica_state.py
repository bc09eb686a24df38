"""One value per weight across a host's replicas: BatchNorm statistics.

Under `MirroredStrategy` a non-trainable weight that a layer assigns in
its call (BatchNormalization's `moving_mean` and `moving_variance`) is a
mirrored variable with no aggregation: each replica updates its own copy
from its own rows, so after training the copies differ. Reading the
variable, `get_weights`, `model.save` and checkpoints give the first
replica's; predicting or evaluating on several replicas used each
replica's own, so rows served by replica 1 disagreed with the saved model
(0.037 in the logits after 3 epochs on 2 replicas) and the batch size
changed the predictions. Keras `fit` + `predict` do the same.

`agree` sets every replica's copy to the first replica's: the model then
predicts everywhere as it saves. A placed model's data-parallel copies
(`ReplicatedModel`: data copies x stages) keep such statistics per copy
too; `agree` sets them to the first copy's likewise, through the placed
model's contract (`placed_model.agree_copies`). Training is unchanged (a replica's own
statistics never enter its gradients, and the first replica's never see
the others), so weights stay equal to Keras'. Across workers each
worker's first replica is kept (workers' copies are not exchanged).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmgpu.parallel import placed_model


def diverging(model: Any) -> list[tf.Variable]:
  """`model`'s floating weights whose replicas update their copies alone
  (mirrored, written in replica context, no aggregation)."""
  found = []
  for v in getattr(model, "variables", ()):
    value = getattr(v, "value", v)  # A keras.Variable's backend variable.
    if (isinstance(value, tf.distribute.DistributedValues)
        and value.dtype.is_floating
        and len(getattr(value, "values", ())) > 1
        and value.synchronization == tf.VariableSynchronization.ON_WRITE
        and value.aggregation == tf.VariableAggregation.NONE
        and not v.trainable):
      found.append(value)
  return found


def agree(model: Any) -> int:
  """Sets each replica's copy of `model`'s diverging weights (`diverging`)
  to the first replica's, the value `get_weights` and `model.save` give,
  and a placed model's data copies' non-trainable weights to the first
  copy's. Returns how many weights it set."""
  found = diverging(model)
  for value in found:
    value.assign(value.values[0].read_value())  # Cross-replica: every copy.
  return len(found) + placed_model.agree_copies(model)
