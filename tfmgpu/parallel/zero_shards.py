"""Where a ZeRO model's state lives: owners, copies, bytes per device.

The pieces `tfmgpu.parallel.zero.ShardedModel` is built from: each
variable's owner among the data-parallel devices (`assign_owners`, balanced
by bytes), a value read on its owner (`read_on_owner`), the copies that
stages 1 and 2 keep of the weights a device does not own (`Copies`, their
all-gather), and the bytes each device holds (`bytes_by_device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmgpu import _compat

from tfmgpu.parallel import zero_memory
from tfmgpu.strategies.options import ZERO_STAGES


def variable_bytes(variable: Any) -> int:
  """Bytes of one variable's storage."""
  shape = tf.TensorShape(variable.shape)
  return int(shape.num_elements() or 0) * tf.as_dtype(variable.dtype).size


def assign_owners(sizes: Sequence[int], num_devices: int) -> list[int]:
  """An owner (device index) per variable, balancing bytes per device.

  Largest first, each onto the device holding the fewest bytes so far (the
  lowest index on ties): no device exceeds the mean by more than the
  largest variable. The accounting (`zero_memory`) uses the same rule.

  Args:
    sizes: bytes of each variable.
    num_devices: the data-parallel devices.

  Returns:
    The owner index of each variable, in the order of `sizes`.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices={num_devices} must be >= 1.")
  return zero_memory.owners_of(sizes, num_devices)


def optimizer_slots(optimizer: keras.optimizers.Optimizer) -> list[Any]:
  """The optimizer's slots (a wrapper's inner optimizer's): its variables
  without the step counter and the learning rate."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  skip = {id(inner.iterations), id(_compat.learning_rate_variable(inner))}
  return [v for v in inner.variables if id(v) not in skip]


def device_name(device: str) -> str:
  """`/device:CPU:1` for any spelling of a device."""
  spec = tf.DeviceSpec.from_string(device)
  return f"/device:{spec.device_type}:{spec.device_index or 0}"


def bytes_by_device(variables: Sequence[Any]) -> dict[str, int]:
  """Bytes of `variables` summed by the device each lives on (each copy of
  a mirrored variable on its own device)."""
  out: dict[str, int] = {}
  for v in unique(variables):
    storage = v.value if isinstance(v, keras.Variable) else v
    for part in getattr(storage, "values", None) or (storage,):
      name = device_name(part.device)
      out[name] = out.get(name, 0) + variable_bytes(part)
  return out


def check_stage(stage: Any) -> int:
  """`stage` as an int in `ZERO_STAGES`, or a ValueError that says so."""
  if stage not in ZERO_STAGES or isinstance(stage, bool):
    raise ValueError(f"zero_stage={stage!r} is not a ZeRO stage. Use one of "
                     f"{', '.join(map(str, ZERO_STAGES))} (0: whole copies, "
                     "1: optimizer slots sharded, 2: and gradients, 3: and "
                     "weights).")
  return int(stage)


def read_on_owner(variable: Any) -> tf.Tensor:
  """The variable's value, read by an op on the variable's own device
  (`convert_to_tensor` would only colocate it, leaving no device in the
  traced graph)."""
  storage = (_compat.variable_storage(variable)
             if isinstance(variable, keras.Variable) else variable)
  with tf.device(storage.device):
    return tf.raw_ops.ReadVariableOp(resource=storage.handle,
                                     dtype=storage.dtype)


def unique(variables: Sequence[Any]) -> list[Any]:
  seen, out = set(), []
  for v in variables:
    if id(v) not in seen:
      seen.add(id(v))
      out.append(v)
  return out


class Copies:
  """Stage 1 and 2: each replica's copies of the weights it does not own.

  A plain object, so that Keras and checkpoints do not track the copies:
  the owners' variables are the model's weights.
  """

  def __init__(self, variables: Sequence[Any], owners: Sequence[int],
               devices: Sequence[str]):
    self.table: list[list[Any]] = []
    for r, device in enumerate(devices):
      row = []
      for v, owner in zip(variables, owners):
        if owner == r:
          row.append(None)
          continue
        with tf.init_scope(), tf.device(device):
          row.append(tf.Variable(tf.identity(v.value), trainable=False,
                                 name=f"zero_copy_{r}"))
      self.table.append(row)

  def gather(self, variables: Sequence[Any]) -> None:
    """Every copy takes its owner's value (the all-gather): read on the
    owner, written on the copy's device."""
    values = [read_on_owner(v) for v in variables]
    for row in self.table:
      for copy, value in zip(row, values):
        if copy is not None:
          with tf.device(copy.device):
            copy.assign(value)
