"""TF's errors from a training step, said in the user's terms.

A step fails deep in TF for causes the user can fix in one line: a batch
of fewer rows than `micro_batches` (a dataset's short last batch, found
only when it comes: TF's `Assert` message is 3 kB long, its point at the
end), or, likely, a batch with fewer rows than replicas, which leaves a replica
an empty slice that some kernels (convolutions) reject: TF names the
replica whose part failed; or a label the model's logits have no class
for (a one-logit model under sparse cross-entropy).
`explain` turns such an error into one that says what to change.
"""

from __future__ import annotations

import re

import tensorflow as tf

_MICRO = re.compile(r"fewer rows than (micro_batches|data_parallel)=(\d+)")
_SIZE = re.compile(r"batch size:\]?\s*\[?(\d+)")
_REPLICA = re.compile(r"/replica_([1-9]\d*)/")
_LABEL = re.compile(r"Received a label value of (-?\d+) which is outside the "
                    r"valid range of \[0, (\d+)\)")


def explain(error: tf.errors.OpError, replicas: int) -> ValueError | None:
  """A clear `ValueError` for `error` from a training step over `replicas`
  replicas, or `None` when it is none of the causes above."""
  text = error.message or ""
  micro = _MICRO.search(text)
  if micro:
    size = _SIZE.search(text)
    name, m = micro.group(1), int(micro.group(2))
    batch = f"of {size.group(1)} examples " if size else ""
    parts, fewer = (("micro-batches", "use fewer micro_batches")
                    if name == "micro_batches" else
                    ("replicas", f"give every batch at least {m} rows"))
    return ValueError(
        f"A batch {batch}has fewer rows than {name}={m} (a dataset's "
        f"short last batch?), so some {parts} would get none: batch the "
        f"dataset with drop_remainder=True, or {fewer}. The steps before it "
        "were trained.")
  label = _LABEL.search(text)
  if label:  # A short batch was blamed; one device gave TF's traceback.
    value, classes = label.groups()
    return ValueError(
        f"A label of {value} is not a class of the model's output, which "
        f"gives {classes} logit(s) per example: sparse categorical "
        f"cross-entropy (the default loss) takes labels 0..{int(classes) - 1}. "
        "End the model with one logit per class (Dense(num_classes)), or "
        "give the loss your targets need (e.g. --loss=mse, or your own "
        "--loss=my_loss.py:fn).")
  replica = _REPLICA.search(text)
  if replicas > 1 and replica:
    said = next((line for line in text.splitlines()
                 if "INVALID_ARGUMENT" in line), text.splitlines()[0])
    return ValueError(
        f"A step failed in replica {replica.group(1)}'s part. If a batch had "
        f"fewer rows than the {replicas} replicas (a dataset's short last "
        "batch), that replica got none, which TF's kernels for some layers "
        "(convolutions) reject, as under Keras' fit: batch the dataset with "
        f"drop_remainder=True or give it a multiple of {replicas} rows. TF "
        f"said: {said.strip()[:300]}")
  return None
