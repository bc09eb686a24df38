"""Reading a generation request: right-padded prompts and their lengths."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
  """Prompts ready for decoding.

  Attributes:
    token_ids: `(B', P)` int32 prompts, right-padded, `P` the longest
      prompt; `B'` is `rows` rounded up to a multiple of the replicas (the
      extra rows repeat the last one and are dropped from the result).
    lengths: `(B',)` each prompt's length.
    rows: the request's own row count `B`.
    first: the first position decoded (the shortest prompt's length).
    width: the output's width: `P` plus the new tokens.
  """
  token_ids: np.ndarray
  lengths: np.ndarray
  rows: int
  first: int
  width: int


def _arrays(inputs: Any) -> tuple[np.ndarray, np.ndarray]:
  """`(token_ids, padding_mask)` of either input form, as 2-D arrays."""
  if isinstance(inputs, dict):
    if set(inputs) != {"token_ids", "padding_mask"}:
      raise ValueError(
          f"inputs has keys {sorted(inputs)}; give {{'token_ids': (B, T) "
          "int, 'padding_mask': (B, T) bool}} or a (B, T) token array.")
    ids = np.asarray(inputs["token_ids"])
    mask = np.asarray(inputs["padding_mask"]).astype(bool)
    if mask.shape != ids.shape:
      raise ValueError(f"inputs padding_mask has shape {mask.shape} but "
                       f"token_ids has {ids.shape}: they must be equal.")
  else:
    ids = np.asarray(inputs)
    if ids.ndim == 1:
      ids = ids[None, :]
    mask = np.ones(ids.shape, bool)
  if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
    raise ValueError(f"inputs token_ids has shape {ids.shape}; give (B, T) "
                     "token ids with B >= 1 and T >= 1.")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"inputs token_ids has dtype {ids.dtype}; give integer "
                     "token ids.")
  return ids, mask


def check_ids(ids: np.ndarray, vocab: int | None, what: str) -> None:
  """Raises `ValueError` naming `what` if a token id in `ids` is negative or,
  when `vocab` is given, not below it (a GPU's gather would read zeros)."""
  ids = np.asarray(ids)
  if not ids.size:
    return
  ids_range = f": 0..{vocab - 1}" if vocab else ""
  if ids.min() < 0:
    raise ValueError(f"{what} holds {int(ids.min())}; token ids are >= 0 "
                     f"(indices into the vocabulary{ids_range}).")
  if vocab and ids.max() >= vocab:
    raise ValueError(f"{what} holds {int(ids.max())}, but the model's "
                     f"vocabulary has {vocab} tokens (ids 0..{vocab - 1}).")


def read(inputs: Any, max_new_tokens: int, max_positions: int | None,
         replicas: int = 1, *, vocab: int | None = None) -> Request:
  """The `Request` of `inputs` (see `tfmgpu.generate`).

  Raises:
    ValueError: a bad shape or dtype, an empty prompt, a prompt that is not
      right-padded, a token id outside the `vocab`, `max_new_tokens` < 1,
      or a sequence longer than the model's `max_positions`.
  """
  if (not isinstance(max_new_tokens, (int, np.integer))
      or isinstance(max_new_tokens, bool) or max_new_tokens < 1):
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive "
                     "int, e.g. 32.")
  ids, mask = _arrays(inputs)
  check_ids(ids[mask], vocab, "inputs token_ids")
  ids = ids.astype(np.int32)
  lengths = mask.sum(axis=1).astype(np.int32)
  right_padded = np.arange(mask.shape[1])[None, :] < lengths[:, None]
  bad = np.flatnonzero((mask != right_padded).any(axis=1) | (lengths == 0))
  if bad.size:
    raise ValueError(
        f"inputs row {int(bad[0])} has padding_mask "
        f"{mask[bad[0]].astype(int).tolist()}: each row needs at least one "
        "prompt token, and its padding only at the end (right-padded).")
  longest = int(lengths.max())
  width = longest + int(max_new_tokens)
  if max_positions is not None and longest >= max_positions:
    raise ValueError(
        f"the longest prompt ({longest} tokens) leaves no room in the "
        f"model's {max_positions} positions: shorten it to at most "
        f"{max_positions - 1} tokens.")
  if max_positions is not None and width > max_positions:
    raise ValueError(
        f"the longest prompt ({longest} tokens) + max_new_tokens="
        f"{max_new_tokens} = {width} positions, more than the model's "
        f"{max_positions}. Use max_new_tokens <= {max_positions - longest} "
        "or a shorter prompt.")
  rows = len(ids)
  padded = -(-rows // replicas) * replicas
  take = np.minimum(np.arange(padded), rows - 1)  # Repeats the last row.
  return Request(token_ids=ids[take, :longest], lengths=lengths[take],
                 rows=rows, first=int(lengths.min()), width=width)
