"""One prompt's tokens as they come, past the model's context if need be.

A model with learned positions (tfmgpu's `gpt`, GPT-2) reads at most
`max_positions` tokens. To write more, generation goes on in windows: when
the window is full, the last half of it becomes the next prompt (read
again by one prefill) and decoding continues. Every window after the first
has the same shape, so their decode step is traced once. A prompt of
`max_positions` tokens or more is read from its last `max_positions - 1`
(`prompt_cut` says how many are left out) for the first new token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from tfmgpu.generation import api
from tfmgpu.generation import samplers


def prompt_cut(generator: "api.Generator", prompt: Sequence[int]) -> int:
  """How many of `prompt`'s first tokens `stream_tokens` leaves out: those
  before its last `max_positions - 1` (0 for a model without a limit)."""
  limit = generator.adapter.max_positions
  return max(0, len(prompt) - (limit - 1)) if limit else 0


def stream_tokens(generator: "api.Generator", prompt: Sequence[int], *,
                  max_new_tokens: int,
                  sampling: samplers.Sampling = samplers.Sampling(),
                  stop_token_ids: Sequence[int] | None = None
                  ) -> Iterator[int]:
  """Yields each new token of one prompt as soon as it is chosen.

  Args:
    generator: a `Generator` of the model.
    prompt: the prompt's token ids (at least one).
    max_new_tokens: tokens to write at most (past the model's context:
      in windows, see the module docstring).
    sampling: the sampler; a seeded one moves to `seed + w` in window `w`.
    stop_token_ids: stop after any of these (it is yielded).

  Raises:
    ValueError: an empty prompt, or bad options (see `tfmgpu.generate`).
  """
  tokens = [int(t) for t in prompt]
  if not tokens:
    raise ValueError("prompt is empty: give at least one token.")
  if int(max_new_tokens) < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive "
                     "int, e.g. 200.")
  limit = generator.adapter.max_positions
  keep = max(1, limit // 2) if limit else None
  left, window = int(max_new_tokens), 0
  stops = set(int(t) for t in stop_token_ids or ())
  while left > 0:
    context = tokens if limit is None or len(tokens) < limit or (
        window == 0) else tokens[-keep:]  # The prompt: as much as fits.
    if limit is not None:
      context = context[-(limit - 1):]
    # A full window even when fewer tokens are left (the stream is left
    # early): every window after the first has one shape, traced once.
    room = left if limit is None else limit - len(context)
    seed = (None if sampling.seed is None
            else samplers.offset_seed(sampling.seed, window))
    for new, written in generator.stream(
        np.asarray([context], np.int32), max_new_tokens=room,
        sampling=dataclasses.replace(sampling, seed=seed),
        stop_token_ids=stop_token_ids):
      if not written[0]:
        continue
      token = int(new[0])
      tokens.append(token)
      left -= 1
      yield token
      if token in stops or not left:
        return
    window += 1
