"""Which whole layers a tensor-parallel split replaces, and how: the rules.

Rules are an ordered `{layer name regex: kind}` (`column`, `row`, `heads`):
the first regex that fully matches a layer's name gives its kind
(`GPT_RULES`: `tfmgpu.models.gpt`'s attention and MLP). A layer a rule
names but that cannot be split that way is refused with its sizes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Callable

import keras

from tfmgpu.parallel import choices
from tfmgpu.parallel import graph as graph_lib

KINDS = choices.TENSOR_KINDS
GPT_RULES: dict[str, str] = dict(choices.TENSOR_RULES_GPT)


def check_rules(rules: Mapping[str, str]) -> dict[str, str]:
  """`rules` as an ordered `{regex: kind}` dict, each regex compiled once.

  Raises:
    ValueError: an unknown kind or a regex that does not compile, naming
      the entry.
  """
  if not isinstance(rules, Mapping) or not rules:
    raise ValueError(f"rules={rules!r} must be a non-empty mapping of layer "
                     f"name regex -> kind ({', '.join(KINDS)}), e.g. "
                     "tfmgpu.parallel.tensor.GPT_RULES.")
  out = {}
  for regex, kind in rules.items():
    if kind not in KINDS:
      raise ValueError(f"rule {regex!r}={kind!r}: unknown kind {kind!r}; "
                       f"choose one of {', '.join(KINDS)}.")
    try:
      re.compile(regex)
    except re.error as e:
      raise ValueError(f"rule {regex!r}={kind!r}: the regex does not "
                       f"compile ({e}).") from e
    out[regex] = kind
  return out


def parse_rules(text: str) -> dict[str, str]:
  """Parses `"regex=kind,regex=kind"` (a flag's value) into ordered rules.

  Each entry splits at its last `=`; entries are separated by commas (so a
  regex cannot hold a comma or end in `=`). Kinds: `column`, `row`,
  `heads`.

  Raises:
    ValueError: an entry without `=`, an empty regex, an unknown kind or a
      regex that does not compile, naming the entry.
  """
  rules = {}
  for entry in (e.strip() for e in str(text).split(",")):
    if not entry:
      continue
    regex, sep, kind = entry.rpartition("=")
    if not sep or not regex.strip():
      raise ValueError(f"tensor-parallel rule {entry!r} must be regex=kind, "
                       f"kind one of {', '.join(KINDS)} (e.g. "
                       "'.*_mlp_up=column,.*_mlp_down=row').")
    rules[regex.strip()] = kind.strip()
  if not rules:
    raise ValueError(f"tensor-parallel rules {text!r} name no rule; give "
                     "regex=kind entries separated by commas.")
  return check_rules(rules)


def rule_for(name: str, rules: Mapping[str, str]) -> str | None:
  """The kind of the first rule whose regex fully matches `name`, or `None`."""
  for regex, kind in rules.items():
    if re.fullmatch(regex, name):
      return kind
  return None


def _cannot_split(layer, kind: str, T: int) -> tuple[str, bool] | None:
  """Why `layer` cannot be split as `kind` over `T` devices, and whether
  another `T` could (only a size that `T` does not divide is in the way);
  `None` when it can."""
  want = (keras.layers.MultiHeadAttention if kind == "heads"
          else keras.layers.Dense)
  if type(layer) is not want:  # pylint: disable=unidiomatic-typecheck
    return f"a {kind!r} rule splits a {want.__name__}, not a " + (
        type(layer).__name__), False
  config = layer.get_config()
  extras = [k for k in ("kernel_regularizer", "bias_regularizer",
                        "activity_regularizer", "kernel_constraint",
                        "bias_constraint", "lora_rank", "quantization_config",
                        "sliding_window", "output_shape")
            if config.get(k)]
  if kind == "heads":
    extras += [k for k in ("use_gate", "dropout") if config.get(k)]
    if tuple(config.get("attention_axes") or (1,)) != (1,):
      extras.append("attention_axes")
  if extras:
    return f"split layers do not support {', '.join(extras)}", False
  if kind == "heads" and layer.num_heads % T:
    return f"num_heads={layer.num_heads} is not divisible by T={T}", True
  if kind == "column" and layer.units % T:
    return f"units={layer.units} is not divisible by T={T}", True
  if kind == "row" and layer.kernel.shape[0] % T:
    return (f"its input dim {layer.kernel.shape[0]} is not divisible by "
            f"T={T}", True)
  return None


def _sizes(layer) -> str:
  if isinstance(layer, keras.layers.MultiHeadAttention):
    return f"num_heads={layer.num_heads}, key_dim={layer.key_dim}"
  if isinstance(layer, keras.layers.Dense) and layer.built:
    return f"input dim {layer.kernel.shape[0]}, units={layer.units}"
  return f"{layer.count_params()} weights" if layer.built else "unbuilt"


def split_kinds(graph: graph_lib.ModelGraph, rules: Mapping[str, str],
                 devices_of: Callable[[str], tuple[str, ...]]
                 ) -> dict[str, str]:
  """`{layer name: kind}` of the layers to split, each checked."""
  kinds = {}
  for node in graph.nodes:
    layer = node.operation
    kind = rule_for(layer.name, rules)
    if kind is None:
      continue
    T = len(devices_of(layer.name))
    cannot = _cannot_split(layer, kind, T)
    if cannot:
      why, by_size = cannot
      raise ValueError(
          f"layer {layer.name!r} ({type(layer).__name__}, {_sizes(layer)}) "
          f"matches a {kind!r} tensor-parallel rule but cannot be split over "
          f"T={T} devices: {why}. Change the rules so they skip it"
          f"{', or use a T that divides its sizes' if by_size else ''}.")
    kinds[layer.name] = kind
  if not kinds:
    names = graph.names
    shown = (", ".join(names) if len(names) <= 12 else
             f"{', '.join(names[:6])}, ..., {', '.join(names[-6:])}; "
             f"{len(names)} in all")
    raise ValueError(
        f"the tensor-parallel rules {dict(rules)} match no layer of model "
        f"{graph.model.name!r}; nothing would be split. Give rules whose "
        "regexes fully match layer names (kinds: column, row, heads): on "
        f"the command line `--tensor_rules={names[-1]}=column`, in Python "
        f"`rules={{{names[-1]!r}: 'column'}}` (the last layer, split by "
        f"columns). Its layers: {shown}.")
  return kinds
