"""Graph inspection: the device every op of a traced function asks for.

`op_placements` walks a concrete function's graph, including nested function
bodies (while/cond bodies, gradient functions), and returns one `OpPlacement`
per op. Tests and notebooks use it to check that each stage's forward,
backward and optimizer update run on the stage's device.
"""

from __future__ import annotations

import dataclasses

from tfmgpu import devices as devices_lib


@dataclasses.dataclass(frozen=True)
class OpPlacement:
  """Where one traced op was asked to run.

  Attributes:
    name: the op name; ops inside a function body (while/cond bodies,
      gradient functions) are prefixed with the name of the op calling it.
    type: the op type, e.g. `"MatMul"`.
    device: the requested device, canonical (`"/device:CPU:1"`), inherited
      from the calling op inside function bodies; `""` if none.
    colocated: the op is pinned next to another op (e.g. a variable read,
      placed with its variable) instead of by device.
  """
  name: str
  type: str
  device: str
  colocated: bool


def op_placements(concrete_function) -> list[OpPlacement]:
  """Every op of a traced function, including nested function bodies.

  Use it to check placement: get a concrete function with
  `tf.function(step).get_concrete_function(...)` and read each op's device.

  Args:
    concrete_function: a `tf.types.experimental.ConcreteFunction`.

  Returns:
    One `OpPlacement` per op, outer graph first.
  """
  graph_def = concrete_function.graph.as_graph_def()
  library = {f.signature.name: f for f in graph_def.library.function}
  out: list[OpPlacement] = []

  def walk(nodes, prefix: str, inherited: str, depth: int) -> None:
    for node in nodes:
      name = prefix + node.name
      device = (devices_lib.canonical_device(node.device) if node.device
                else inherited)
      out.append(OpPlacement(name, node.op, device, "_class" in node.attr))
      for attr in node.attr.values():
        funcs = ([attr.func.name] if attr.HasField("func") else
                 [f.name for f in attr.list.func])
        for fname in funcs:
          if fname in library and depth < 32:
            walk(library[fname].node_def, name + "/", device, depth + 1)

  walk(graph_def.node, "", "", 0)
  return out



def _live_ops(graph, outputs) -> list:
  """The ops of `graph` that `outputs` or a stateful op depend on: what
  TensorFlow runs (the rest is pruned)."""
  todo = [t.op for t in outputs] + [op for op in graph.get_operations()
                                    if op.op_def.is_stateful]
  live = {}
  while todo:
    op = todo.pop()
    if op.name not in live:
      live[op.name] = op
      todo.extend(t.op for t in op.inputs)
      todo.extend(op.control_inputs)
  return list(live.values())


def cross_device_bytes(concrete_function) -> dict[tuple[str, str], int]:
  """The bytes a traced function sends between devices, per `(from, to)`
  device pair: each tensor an op reads from an op on another device, once
  per receiving device, counting only the ops the function runs (its
  outputs' and side effects' inputs, not dead ones TensorFlow prunes).
  Tensors of unknown size or of resource/variant type count as 0; ops
  inside nested function bodies (loops) are not looked into.

  Args:
    concrete_function: a `tf.types.experimental.ConcreteFunction`.

  Returns:
    `{(from device, to device): bytes}`, devices canonical.
  """
  graph = concrete_function.graph
  sent: dict[tuple[str, str], int] = {}
  seen = set()
  for op in _live_ops(graph, concrete_function.outputs):
    to = devices_lib.canonical_device(op.device) if op.device else ""
    for t in op.inputs:
      source = t.op.device
      frm = devices_lib.canonical_device(source) if source else ""
      if not frm or not to or frm == to or (t.ref(), to) in seen:
        continue
      seen.add((t.ref(), to))
      size = t.shape.num_elements() if t.shape.is_fully_defined() else None
      if size is None or t.dtype.name in ("resource", "variant"):
        continue
      sent[frm, to] = sent.get((frm, to), 0) + size * t.dtype.size
  return sent
