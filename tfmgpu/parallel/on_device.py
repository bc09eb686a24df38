"""A computation with its forward and its backward on one device.

`tf.device` places the forward ops of what runs under it, but one outer
`tf.GradientTape` puts every gradient op on the caller's device. `on_device`
wraps a piece of work in a `tf.custom_gradient` whose gradient function
differentiates it under the same device, so each tensor-parallel shard's
backward runs beside its weights, whatever the caller's device scope.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def _is_float(t: Any) -> bool:
  return t.dtype.is_floating or t.dtype.is_complex


def on_device(device: str, fn: Callable[..., Any], *inputs: Any,
              name: str = "on_device") -> Any:
  """`fn(*inputs)` with its forward and its backward on `device`.

  The forward runs under `tf.device(device)`, recorded by an inner tape; the
  gradient function (a `tf.custom_gradient`) differentiates that tape under
  `tf.device(device)` too, so the shard's gradient ops stay on its device
  whichever device scope the outer tape's `gradient` call runs under. It
  returns gradients for the floating-point inputs (`None` for integer and
  boolean ones, such as masks) and for every variable `fn` reads. Works
  eagerly and in `tf.function`, under any outer `tf.GradientTape`.

  Args:
    device: where to run.
    fn: takes `inputs` (tensors, or lists of them) and returns a tensor or a
      list of tensors.
    *inputs: tensors or nested structures of tensors (no `None`).
    name: name scope of the forward ops; the backward's is `name +
      "_backward"`.

  Returns:
    What `fn` returns.
  """
  flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]

  @tf.custom_gradient
  def run(*args):
    with tf.device(device), tf.name_scope(name):
      with tf.GradientTape() as tape:
        # Fresh tensors: an input passed twice (attention's query and value)
        # gets the gradient of each use, not the sum of both twice.
        local = [tf.identity(a) if _is_float(a) else a for a in args]
        watched = [a for a in local if _is_float(a)]
        tape.watch(watched)
        out = fn(*tf.nest.pack_sequence_as(inputs, local))
    flat_out = tf.nest.flatten(out)

    def grad_fn(*dys, variables=None):
      variables = list(variables or [])
      with tf.device(device), tf.name_scope(f"{name}_backward"):
        # A `None` seed (an output nobody read) would count as ones.
        seeds = [tf.zeros_like(y) if d is None else d
                 for y, d in zip(flat_out, dys)]
        grads = tape.gradient(flat_out, watched + variables,
                              output_gradients=seeds)
      from_watched = iter(grads[:len(watched)])
      in_grads = [next(from_watched) if _is_float(a) else None for a in args]
      if not variables:
        return in_grads
      return in_grads, grads[len(watched):]

    return out, grad_fn

  with tf.device(device):
    return run(*flat)
