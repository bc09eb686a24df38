"""Language-model metrics from logits: `bits_per_byte` and `perplexity`.

Both keep two states, the summed token cross-entropy (nats) and the summed
token weight, whose variables aggregate by SUM, so tfmgpu's summed-state
reduction over replicas, micro-batches, stages and workers is exact. The
result is the mean cross-entropy over every token seen: `/ ln 2` for bits
per token (per byte, for byte-level models), `exp` for perplexity. They
take logits, like the default loss (sparse categorical cross-entropy from
logits), and targets of class indices of any shape (`(B,)`, `(B, T)`).

`METRICS` maps the names `--metrics` accepts to the classes.
"""

from __future__ import annotations

import math

import keras
from keras import ops


class MeanTokenCrossEntropy(keras.metrics.Metric):
  """The mean sparse cross-entropy over every token (nats).

  Predictions are logits unless `from_logits=False` (probabilities, as a
  model ending in softmax gives). Sample weights of shape `(B,)` (one per
  example) or the targets' shape (one per token) weigh each token; the mean
  is over the summed weights.
  """

  def __init__(self, name: str = "mean_token_cross_entropy",
               dtype: str | None = None, from_logits: bool = True):
    super().__init__(name=name, dtype=dtype)
    self.from_logits = bool(from_logits)
    self.total = self.add_variable(shape=(), initializer="zeros",
                                   dtype="float32", aggregation="sum",
                                   name="total")
    self.count = self.add_variable(shape=(), initializer="zeros",
                                   dtype="float32", aggregation="sum",
                                   name="count")

  def update_state(self, y_true, y_pred, sample_weight=None):
    """Adds the batch's summed token cross-entropy and token weight."""
    losses = keras.losses.sparse_categorical_crossentropy(
        y_true, ops.cast(y_pred, "float32"), from_logits=self.from_logits)
    if sample_weight is None:
      weight = ops.ones_like(losses)
    else:
      weight = ops.cast(ops.convert_to_tensor(sample_weight), "float32")
      while len(weight.shape) > len(losses.shape) and weight.shape[-1] == 1:
        weight = ops.squeeze(weight, -1)
      while len(weight.shape) < len(losses.shape):
        weight = ops.expand_dims(weight, -1)
      weight = ops.broadcast_to(weight, ops.shape(losses))
    self.total.assign_add(ops.sum(losses * weight))
    self.count.assign_add(ops.sum(weight))

  def mean(self):
    """The mean token cross-entropy in nats (0 before any token)."""
    return ops.divide_no_nan(self.total, self.count)

  def result(self):
    return self.mean()

  def get_config(self):
    return {**super().get_config(), "from_logits": self.from_logits}


@keras.saving.register_keras_serializable(package="tfmgpu")
class BitsPerByte(MeanTokenCrossEntropy):
  """Mean token cross-entropy in bits (`nats / ln 2`): bits per byte for a
  byte-level model, bits per token otherwise."""

  def __init__(self, name: str = "bits_per_byte", dtype: str | None = None,
               from_logits: bool = True):
    super().__init__(name=name, dtype=dtype, from_logits=from_logits)

  def result(self):
    return self.mean() / math.log(2.0)


@keras.saving.register_keras_serializable(package="tfmgpu")
class Perplexity(MeanTokenCrossEntropy):
  """`exp` of the mean token cross-entropy."""

  def __init__(self, name: str = "perplexity", dtype: str | None = None,
               from_logits: bool = True):
    super().__init__(name=name, dtype=dtype, from_logits=from_logits)

  def result(self):
    return ops.exp(self.mean())


# The names `--metrics` / `Trainer(metrics=...)` accept, lower case.
METRICS: dict[str, type[MeanTokenCrossEntropy]] = {
    "bits_per_byte": BitsPerByte,
    "perplexity": Perplexity,
}
