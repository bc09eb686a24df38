"""Megatron's MLP inside blocks: column outputs stay on their shards.

A kernel split along an output axis (column-parallel: an MLP's up and gate
kernels) computes its part, its slice of the bias and the activation on
each shard, and joins the parts on `devices[0]` for any reader of the whole
output; `mark` records the parts beside the joined tensor. A kernel split
along a contracted axis (row-parallel: the down kernel) asks `trace`
whether its input is an elementwise function of such joined outputs (the
block's own gating and activation, e.g. Llama's `silu(gate) * up`, Gemma's
`gelu(x1) * x2`, casts), read from the traced graph. If so each shard
replays that function on its own parts on its device (`Plan.run`) and
multiplies by its rows: the joins become dead ops that TensorFlow prunes,
and the MLP costs one sum (forward; one sum of the input's gradients
backward) instead of a join per kernel. Eagerly (no graph to read), or when
the input is anything else, the row shards slice the whole input as
before; both give the same numbers.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

# Ops that act on each element (broadcasting), replayed per shard.
ELEMENTWISE = frozenset((
    "Add", "AddV2", "Cast", "Div", "Elu", "Erf", "Exp", "Identity",
    "IdentityN", "Log1p", "Maximum", "Minimum", "Mul", "Neg", "Pow",
    "RealDiv", "Reciprocal", "Relu", "Relu6", "Rsqrt", "Selu", "Sigmoid",
    "Softplus", "Softsign", "Sqrt", "Square", "Sub", "Tanh"))
_MAX_OPS = 64  # Longer elementwise chains are not looked through.

# graph -> {joined tensor's ref: (its parts, the axis they split)}
_PARTS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def mark(joined: Any, parts: Sequence[Any], axis: int) -> None:
  """Records that `joined` is `parts` concatenated along `axis` (a traced
  graph's tensors; nothing eagerly)."""
  if not tf.executing_eagerly() and hasattr(joined, "graph"):
    _PARTS.setdefault(joined.graph, {})[joined.ref()] = (tuple(parts),
                                                         int(axis))


@dataclasses.dataclass
class Plan:
  """How to compute a tensor on each shard from marked parts.

  Attributes:
    leaves: the marked joined tensors it reads.
    parts: each leaf's parts (`parts[i][t]`: leaf `i` on shard `t`).
    ops: the elementwise ops between, in order.
    output: the tensor it computes.
  """
  leaves: list[Any]
  parts: list[tuple[Any, ...]]
  ops: list[Any]
  output: Any

  def leaves_of(self, t: int) -> list[Any]:
    """Shard `t`'s parts of the leaves (pass them to its `on_device`)."""
    return [p[t] for p in self.parts]

  def run(self, t: int, leaves: Sequence[Any]) -> Any:
    """Shard `t`'s slice of `output`, from its parts `leaves`."""
    del t
    values = {leaf.ref(): v for leaf, v in zip(self.leaves, leaves)}
    for op in self.ops:
      ins = [values.get(i.ref(), i) for i in op.inputs]
      for out, value in zip(op.outputs, _replay(op, ins)):
        values[out.ref()] = value
    return values[self.output.ref()]


def _replay(op: Any, inputs: list[Any]) -> list[Any]:
  """`op` run again on `inputs` (same type and attributes)."""
  if op.type in ("Identity", "IdentityN"):
    return inputs
  inferred = set()
  for arg in op.op_def.input_arg:
    inferred |= {arg.type_attr, arg.number_attr, arg.type_list_attr}
  attrs = {a.name: op.get_attr(a.name) for a in op.op_def.attr
           if a.name not in inferred}
  names = [a.name for a in op.op_def.input_arg]
  return [getattr(tf.raw_ops, op.type)(**dict(zip(names, inputs)), **attrs)]


def _broadcast_safe(tensor: Any, axis: int, rank: int) -> bool:
  """Whether `tensor` broadcasts along the split axis (size 1 or absent)."""
  shape = tensor.shape
  if shape.rank is None:
    return False
  offset = axis - rank + shape.rank  # Aligned from the right.
  return offset < 0 or shape[offset] == 1


def trace(tensor: Any, parts: int, axis: int) -> Plan | None:
  """The `Plan` computing `tensor` per shard from marked column outputs
  split in `parts` along `axis`, or `None` (eager, or not such a function:
  slice it instead).

  Only constants (and elementwise functions of them) that broadcast along
  `axis` may enter besides the marked parts: every other input would need
  its own gradient.
  """
  store = _PARTS.get(getattr(tensor, "graph", None)) if not (
      tf.executing_eagerly()) else None
  if not store or tensor.shape.rank is None:
    return None
  rank = tensor.shape.rank
  axis %= rank
  plan = Plan([], [], [], tensor)
  kinds: dict[Any, str] = {}

  def visit(t: Any) -> str:
    """'leaf', 'node' (depends on leaves), 'const' or 'no'."""
    if t.ref() in kinds:
      return kinds[t.ref()]
    marked = store.get(t.ref())
    if marked is not None:
      ok = len(marked[0]) == parts and marked[1] % rank == axis and (
          t.shape.rank == rank)
      kind = "leaf" if ok else "no"
      if ok:
        plan.leaves.append(t)
        plan.parts.append(marked[0])
    elif t.op.type == "Const":
      kind = "const" if _broadcast_safe(t, axis, rank) else "no"
    elif t.op.type in ELEMENTWISE and len(plan.ops) < _MAX_OPS:
      found = {visit(i) for i in t.op.inputs}
      kind = ("no" if "no" in found else
              "node" if found & {"leaf", "node"} else
              "const" if _broadcast_safe(t, axis, rank) else "no")
      if kind == "node" and t.op not in plan.ops:
        plan.ops.append(t.op)
    else:
      kind = "no"
    kinds[t.ref()] = kind
    return kind

  return plan if visit(tensor) in ("leaf", "node") else None
