"""The variables a step trains when parameter servers split them.

A `ParameterServerStrategy` with a `variable_partitioner`
(`--variable_shards=N`) stores each variable as a `ShardedVariable`: parts
along the first axis, each on a server. A Keras 3 variable holding one can
be read (its parts joined) but neither taken as a `GradientTape` source (it
has no resource handle) nor updated by a Keras optimizer (TensorFlow's
`extended.update` cannot colocate with it); Keras 3's own `fit`, which does
not run parameter servers, never met one. tf.keras 2 trained the parts as
the layer's weights, and so does the step here: the tape differentiates
with respect to each part and the optimizer updates each part on its server,
with slots of the part's shape beside it (`trainable_parts`). The update is
elementwise, so this is the whole variable's update, part by part.
"""

from __future__ import annotations

from typing import Any

import keras

from tfmgpu import _compat


def trainable_parts(model: keras.Model) -> list[Any]:
  """`model.trainable_variables`, each split one replaced by its parts (in
  order): the variables a step differentiates and the optimizer updates."""
  variables = []
  for variable in model.trainable_variables:
    parts = _compat.variable_shards(variable)
    variables.extend([variable] if parts is None else parts)
  return variables
