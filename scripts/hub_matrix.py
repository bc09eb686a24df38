"""keras_hub models through every layout, against one-device Keras `fit`.

Tiny `GPT2CausalLM`, `BertTextClassifier` (the registry's `bert`, which
wraps it), `LlamaCausalLM`, `GemmaCausalLM` and `QwenCausalLM` (random
weights, dropout 0) train 3 steps (SGD, and Adam: its squared gradients
tell a tied weight's summed gradient from its parts) on random tokens with
Keras `fit` on one device, and from the same weights under each
layout: mirrored x2, model_parallel 2, pipeline 2 (GPipe and 1F1B, 2
micro-batches), tensor 2 (the backbone's own layout map, or keras_hub path
rules for GPT-2 and BERT), data 2 x tensor 2 and data 2 x stages 2 x
tensor 2 (1F1B). Language models take a per-token loss with the padding mask
as sample weight. Printed per case: the largest difference of predictions
before training and of the weights after it (the placed model's copied back
into the unsplit model with `copy_weights_to`).

    python3 scripts/hub_matrix.py [--models=gpt2,llama] [--layouts=tensor2]
        [--optimizers=sgd,adam]

Needs 8 logical devices (made here) and keras-hub. Takes minutes on a CPU.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

VOCAB, LENGTH, BATCH, STEPS, LR = 64, 8, 4, 3, 0.5
TINY = dict(num_layers=2, hidden_dim=16, intermediate_dim=32)

LAYOUTS: dict[str, dict[str, Any] | None] = {
    "mirrored2": None,
    "model_parallel2": dict(stages=2),
    "gpipe2": dict(stages=2, micro_batches=2, schedule="gpipe"),
    "1f1b2": dict(stages=2, micro_batches=2, schedule="1f1b"),
    "tensor2": dict(tensor=2),
    "data2_tensor2": dict(data=2, tensor=2),
    "2x2x2": dict(data=2, stages=2, tensor=2, micro_batches=2,
                  schedule="1f1b"),
}


def build(family: str, seed: int = 0):
  """A tiny keras_hub task model, seeded. `family+frozen`: its first block
  and its second block's attention frozen (`trainable = False`);
  `family+lora`: its backbone's LoRA enabled (rank 2, the B factors drawn,
  so that both factors train)."""
  import keras  # pylint: disable=g-import-not-at-top
  family, _, variant = family.partition("+")
  keras.utils.set_random_seed(seed)
  if family == "bert":  # The registry's: a BertTextClassifier, wrapped.
    from tfmgpu import models  # pylint: disable=g-import-not-at-top
    return models.build_model("bert", input_shape=dict(
        token_ids=(LENGTH,), padding_mask=(LENGTH,)), num_classes=3)
  from tfmgpu.models import hub  # pylint: disable=g-import-not-at-top
  model = hub.causal_lm(family, vocabulary_size=VOCAB, sequence_length=LENGTH)
  VARIANTS[variant](model, seed)
  return model


def _freeze(model, seed: int) -> None:
  del seed
  first, second = model.backbone.transformer_layers[:2]
  first.trainable = False
  next(l for l in second._flatten_layers()  # pylint: disable=protected-access
       if "Attention" in type(l).__name__).trainable = False


def _lora(model, seed: int) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  model.backbone.enable_lora(2)
  rng = np.random.RandomState(seed)
  for v in model.weights:
    if "lora_kernel_b" in v.path:
      v.assign(rng.normal(scale=0.1, size=v.shape).astype("float32"))


VARIANTS: dict[str, Callable[[Any, int], None]] = {
    "": lambda model, seed: None, "frozen": _freeze, "lora": _lora}


def data(family: str):
  """`(x, y, sample_weight)`: `STEPS` batches of random tokens."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  n = BATCH * STEPS
  mask = np.ones((n, LENGTH), "int32")
  mask[:, -2:] = 0
  x = {"token_ids": rng.randint(1, VOCAB, (n, LENGTH)).astype("int32"),
       "padding_mask": mask}
  if family.startswith("bert"):
    return x, rng.randint(0, 3, n).astype("int32"), None
  return x, rng.randint(1, VOCAB, (n, LENGTH)).astype("int32"), \
      mask.astype("float32")


OPTIMIZERS = {"sgd": lambda keras: keras.optimizers.SGD(LR),
              "adam": lambda keras: keras.optimizers.Adam(0.01)}


def fit(model, x, y, sample_weight, optimizer: str = "sgd") -> None:
  import keras  # pylint: disable=g-import-not-at-top
  with model.distribute_strategy.scope():  # Adam's slots: the model's.
    model.compile(optimizer=OPTIMIZERS[optimizer](keras),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH,
            shuffle=False, verbose=0)


def _placed(family: str, layout: str, devices: list[str]):
  """`(model to train, fn() -> its weights in unsplit form, unsplit copy
  it predicts like)`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  if LAYOUTS[layout] is None:
    strategy = tf.distribute.MirroredStrategy(
        devices[:2], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
      model = build(family)
    return model, model.get_weights, model
  model = build(family)
  placed = hybrid.build_layout(model, hybrid.Layout(**LAYOUTS[layout]),
                               devices=devices)

  def weights():
    out = build(family, seed=7)
    placed.copy_weights_to(out)
    return out.get_weights()

  return placed, weights, model


def reference_weights(family: str, optimizer: str = "sgd") -> list:
  """The weights of `family` after one-device Keras `fit` with `optimizer`."""
  x, y, sw = data(family)
  reference = build(family)
  fit(reference, x, y, sw, optimizer)
  return reference.get_weights()


def run_case(family: str, layout: str, devices: list[str],
             optimizer: str = "sgd",
             reference: list | None = None) -> tuple[float, float]:
  """`(max |predict - unsplit predict|, max |weights - one-device fit's|)`,
  both trained with `optimizer` (a key of `OPTIMIZERS`); `reference`: the
  one-device weights if already trained (`reference_weights`)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  x, y, sw = data(family)
  if reference is None:
    reference = reference_weights(family, optimizer)
  placed, weights, unsplit = _placed(family, layout, devices)
  predicted = np.abs(placed.predict(x, batch_size=BATCH, verbose=0) -
                     unsplit.predict(x, batch_size=BATCH, verbose=0)).max()
  fit(placed, x, y, sw, optimizer)
  diff = max(float(np.abs(a - b).max())
             for a, b in zip(weights(), reference))
  return float(predicted), diff


def _devices(n: int = 8) -> list[str]:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * n)
  return [d.name for d in tf.config.list_logical_devices("CPU")]


def main(argv: list[str] | None = None,
         out: Callable[[str], None] = print) -> list[tuple]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="gpt2,bert,llama,gemma,qwen")
  parser.add_argument("--layouts", default=",".join(LAYOUTS))
  parser.add_argument("--optimizers", default="sgd,adam",
                      help=f"Of {sorted(OPTIMIZERS)}.")
  args = parser.parse_args(argv)
  devices = _devices()
  rows = []
  out(f"{'model':8} {'layout':16} {'optimizer':9} {'predict':>10} "
      f"{'weights':>10} {'ok':>3} {'seconds':>8}")
  cases = [(f, l, o) for f in args.models.split(",")
           for l in args.layouts.split(",") for o in args.optimizers.split(",")]
  for family, layout, optimizer in cases:
    start = time.perf_counter()
    try:
      predicted, diff = run_case(family, layout, devices, optimizer)
      ok = "yes" if max(predicted, diff) <= 1e-5 else "NO"
      row = (family, layout, optimizer, f"{predicted:.1e}", f"{diff:.1e}",
             ok)
    except Exception as e:  # pylint: disable=broad-except
      row = (family, layout, optimizer, "error", f"{type(e).__name__}: "
             f"{str(e)[:70]}", "NO")
    rows.append(row)
    out(f"{row[0]:8} {row[1]:16} {row[2]:9} {row[3]:>10} {row[4]:>10} "
        f"{row[5]:>3} {time.perf_counter() - start:8.1f}")
  return rows


if __name__ == "__main__":
  main()
