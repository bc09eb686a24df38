"""KV-cache memory of text generation, per device of a layout.

Generating with a KV cache (`tfmgpu.generation`) keeps, for every
attention layer, the keys and values of every position of every request
row: `2 * rows * context * kv_heads * head_dim` values. Placed as
`tfmgpu.generation` places it (`hybrid.Layout`: `R` data copies, `K`
stages, `T` tensor shards):

* rows: each data copy holds `ceil(batch / R)` of them;
* stage: an attention layer's cache is on the stage that holds the layer
  (`StagePlan.stage_of`);
* shards: an attention a tensor rule splits by heads (`heads`) keeps
  `kv_heads / T` heads' cache on each of the `T` devices; an unsplit one
  keeps it whole on the stage's first device.

A keras_hub `CausalLM` counts each of its backbone's blocks (key/value
heads under grouped-query attention) on the stage holding the block; under
tensor parallelism each shard keeps its heads' part (one head each when
there are fewer key/value heads than shards), as `generation.hub_blocks`
makes it beside the shard's attention (`parallel.split_hub_attention`).

`serving_table` puts the cache beside the weights each device holds (from
`tfmgpu.parallel.accounting`): what a device needs to serve.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tfmgpu.parallel import choices
from tfmgpu.parallel import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class CacheLayer:
  """Attention layers whose keys and values a generation caches.

  Attributes:
    name: the model's layer holding them (a keras_hub block's name).
    kv_heads: key/value heads per block.
    head_dim: the width of one head.
    value_bytes: bytes of one cached value (the compute dtype's).
    count: blocks in the layer.
    split: a `heads` tensor rule splits it over the `T` shards.
  """
  name: str
  kv_heads: int
  head_dim: int
  value_bytes: int = 4
  count: int = 1
  split: bool = False

  def bytes(self, rows: int, context: int, tensor: int = 1) -> int:
    """Bytes of one shard's cache for `rows` rows of `context` positions."""
    # Fewer key/value heads than shards: each shard caches the one head it
    # reads (`split_hub_attention`).
    heads = max(self.kv_heads // tensor, 1) if self.split else self.kv_heads
    return 2 * rows * context * heads * self.head_dim * self.value_bytes * (
        self.count)


def _value_bytes(layer: Any) -> int:
  dtype = str(getattr(layer, "compute_dtype", "float32") or "float32")
  return 2 if "16" in dtype else 8 if "64" in dtype else 4


def cache_layers(model: Any, rules: Mapping[str, str] | None = None
                 ) -> list[CacheLayer]:
  """The layers of `model` a generation caches, in model order.

  Args:
    model: tfmgpu's `gpt` (Keras `MultiHeadAttention` layers), or a
      keras_hub `CausalLM`.
    rules: the tensor rules; an attention a `heads` rule names is split.
      Defaults to `choices.TENSOR_RULES_GPT`.
  """
  rules = choices.TENSOR_RULES_GPT if rules is None else rules
  heads_rules = [r for r, kind in rules.items() if kind == "heads"]
  lm = _hub_lm(model)
  backbone = getattr(lm, "backbone", None)
  if backbone is not None and hasattr(backbone, "num_layers"):
    heads = (getattr(backbone, "num_query_heads", None)
             or backbone.num_heads)
    kv = getattr(backbone, "num_key_value_heads", None) or heads
    dim = getattr(backbone, "head_dim", None) or backbone.hidden_dim // heads
    # Split by heads under tensor parallelism, as `split_hub_attention`
    # splits a block's attention (a layout that splits none is refused).
    return [CacheLayer(block.name, int(kv), int(dim), _value_bytes(lm),
                       split=True)
            for block in backbone.transformer_layers]
  return [CacheLayer(layer.name, int(layer.num_heads), int(layer.key_dim),
                     _value_bytes(layer), 1,
                     any(re.fullmatch(r, layer.name) for r in heads_rules))
          for layer in model.layers
          if hasattr(layer, "num_heads") and hasattr(layer, "key_dim")]


def per_device(model: Any, layout: Any, *, batch: int, context: int,
               plan: plan_lib.StagePlan | None = None,
               rules: Mapping[str, str] | None = None,
               devices: Sequence[str] | None = None) -> dict[str, int]:
  """`{device: KV-cache bytes}` of replica 0's devices (mesh order).

  Args:
    model: a built `gpt` or keras_hub `CausalLM` (the unsplit model).
    layout: has `data`, `stages` and `tensor` (`hybrid.Layout`).
    batch: request rows over all copies.
    context: positions per row (the longest prompt + new tokens).
    plan: the cut into `layout.stages` stages (or `stages * V`
      interleaved chunks, chunk `k` on stage `k % stages`' device);
      `plan_stages` when `None`.
    rules: the tensor rules (`TENSOR_RULES_GPT` by default).
    devices: replica 0's `K * T` device names (default `/device:GPU:i`).

  Raises:
    ValueError: `batch` or `context` below 1.
  """
  for name, value in (("batch", batch), ("context", context)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be an int >= 1.")
  K, T = layout.stages, layout.tensor
  names = list(devices or [f"/device:GPU:{i}" for i in range(K * T)])
  if plan is None and K > 1:
    from tfmgpu.parallel import partition  # pylint: disable=g-import-not-at-top
    plan = partition.plan_stages(model, K, devices=names[::T][:K],
                                 check_devices=False)
  rows = math.ceil(batch / layout.data)
  out = dict.fromkeys(names, 0)
  for layer in cache_layers(model, rules):
    k = plan.stage_of(layer.name) % K if K > 1 else 0  # Interleaved: V
    # chunks a device, chunk `k` on the device of stage `k % K`.
    shards = range(T) if layer.split and T > 1 else range(1)
    for t in shards:
      out[names[k * T + t]] += layer.bytes(rows, context,
                                           T if layer.split else 1)
  return out


def serving_table(model: Any, layout: Any, *, batch: int, context: int,
                  rules: Mapping[str, str] | None = None,
                  devices: Sequence[str] | None = None,
                  plan: plan_lib.StagePlan | None = None) -> str:
  """Per device of replica 0: the weights it holds, its KV cache for
  `batch` rows of `context` positions, and their sum (`plan`: the cut into
  stages, `plan_stages` when `None`)."""
  from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
  acc = accounting.account(
      model, layout, global_batch_size=layout.data * (
          layout.micro_batches or 1), rules=rules, devices=devices,
      plan=plan)
  names = [d.device for d in acc.devices]
  cache = per_device(model, layout, batch=batch, context=context,
                     rules=rules, devices=names, plan=plan)
  fmt = plan_lib._fmt_bytes  # pylint: disable=protected-access
  rows = [(d.device, fmt(d.memory.weights), fmt(cache[d.device]),
           fmt(d.memory.weights + cache[d.device])) for d in acc.devices]
  header = ("device", "weights", "KV cache", "total")
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(4)]
  line = lambda r: "  ".join([r[0].ljust(widths[0])] + [
      c.rjust(w) for c, w in zip(r[1:], widths[1:])])
  title = (f"Serving {acc.label} of {acc.model_name!r}: {batch} row(s) of "
           f"{context} positions, {math.ceil(batch / layout.data)} per data "
           "copy; per device of copy 0:")
  return "\n".join([title, line(header)] + [line(r) for r in rows])


def _hub_lm(model: Any) -> Any:
  """The keras_hub `CausalLM` that `model` is or wraps as one of its
  layers (`tfmgpu.models.hub`'s wrapper), else `None`."""
  for candidate in [model, *getattr(model, "layers", ())]:
    if callable(getattr(candidate, "call_with_cache", None)):
      return candidate
  return None


def is_causal_lm(model: Any) -> bool:
  """Whether `model` generates text: a keras_hub `CausalLM` (its
  `call_with_cache`; or a model wrapping one, as `--model=llama` does) or
  tfmgpu's `gpt` (its layer names)."""
  if _hub_lm(model) is not None:
    return True
  names = {layer.name for layer in getattr(model, "layers", ())}
  return {"block0_attention", "position_embedding", "logits"} <= names


def plan_section(model: Any, layout: Any, *, batch: int,
                 context: int | None,
                 rules: Mapping[str, str] | None = None,
                 devices: Sequence[str] | None = None,
                 plan: plan_lib.StagePlan | None = None) -> str | None:
  """What `--plan_only` adds for a causal LM: `serving_table` (weights and
  KV cache per device of copy 0) for `batch` rows of `context` positions;
  `None` for other models.

  Args:
    model: the unsplit model (built with weight shapes only is enough).
    layout: the run's `hybrid.Layout` (`None`: one whole copy).
    batch: rows served at once; a run passes its global batch size.
    context: positions per row; a run passes its sequence length (the
      input width). `None`: the model's own input width (no section when
      it has none).
    rules, devices, plan: as for `serving_table`.
  """
  if not is_causal_lm(model):
    return None
  rules = rules if isinstance(rules, Mapping) else None  # "layout_map".
  if layout is None:
    from tfmgpu.parallel import layout as layout_lib  # pylint: disable=g-import-not-at-top
    layout = layout_lib.Layout()
  if context is None:  # The model's input width, when it has one.
    inputs = getattr(model, "inputs", None) or [None]
    context = getattr(inputs[0], "shape", (None, None))[1]
    if context is None:
      return None
  table = serving_table(model, layout, batch=batch, context=context,
                        rules=rules, devices=devices, plan=plan)
  return (f"Generation: the global batch size ({batch} rows) at the "
          f"sequence length ({context} positions); other sizes: python -m "
          "tfmgpu.generate --memory_plan --serve_batch=N.\n" + table)
