"""Choosing the next token from logits: greedy, top-k, top-p, temperature.

Every sampler is a pure function of `(logits, seed, rows, position)`: its
randomness is a counter-based hash of the seed, the row's index in the
whole request, the position being filled and the vocabulary entry, so one
seed gives the same tokens twice, however the rows are split over
replicas, copies or batches, compiled with XLA or not (TF's stateless
random ops draw other numbers under XLA than without it, even for one
named algorithm). The row's index is its place in the call: the same
prompt at another index, or sent alone, draws other numbers.
"""

from __future__ import annotations

import dataclasses
import numbers

import tensorflow as tf

SAMPLERS = ("greedy", "top_k", "top_p", "random")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen (validated on construction).

  Attributes:
    sampler: `greedy` (the most likely token), `top_k` (one of the `k` most
      likely), `top_p` (from the smallest set whose probability reaches
      `p`), or `random` (from the whole distribution).
    k: for `top_k`, a positive int.
    p: for `top_p`, in (0, 1].
    temperature: logits are divided by it before sampling (not greedy).
    seed: an int; `None` draws one at random for each `generate` call.
  """
  sampler: str = "greedy"
  k: int | None = None
  p: float | None = None
  temperature: float = 1.0
  seed: int | None = None

  def __post_init__(self):
    if self.sampler not in SAMPLERS:
      raise ValueError(f"sampler={self.sampler!r} is unknown. Choose one of "
                       f"{', '.join(SAMPLERS)}.")
    if self.sampler == "top_k" and (
        not isinstance(self.k, numbers.Integral) or isinstance(self.k, bool)
        or self.k < 1):
      raise ValueError(f"k={self.k!r} must be a positive int for "
                       "sampler='top_k', e.g. k=40.")
    if self.sampler == "top_p" and (
        self.p is None or not 0.0 < float(self.p) <= 1.0):
      raise ValueError(f"p={self.p!r} must be in (0, 1] for "
                       "sampler='top_p', e.g. p=0.9.")
    for name, owner in (("k", "top_k"), ("p", "top_p")):
      if getattr(self, name) is not None and self.sampler != owner:
        raise ValueError(
            f"{name}={getattr(self, name)!r} is read only by sampler="
            f"{owner!r}, not sampler={self.sampler!r}: pass sampler="
            f"{owner!r}, or drop {name}.")
    if not float(self.temperature) > 0.0:
      raise ValueError(f"temperature={self.temperature!r} must be > 0, e.g. "
                       "1.0 (greedy ignores it).")
    if self.seed is not None:
      object.__setattr__(self, "seed", _checked_seed(self.seed))


# The seeds the samplers' int32 counters tell apart.
SEED_RANGE = (-2**31, 2**31 - 1)


def _checked_seed(seed: object) -> int:
  """`seed` as an int in `SEED_RANGE` (a NumPy integer too).

  Raises:
    ValueError: not an integer, or outside the range, where seeds 2**32
      apart wrote the same tokens, silently (a new user's trial).
  """
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"seed={seed!r} must be an int or None.")
  low, high = SEED_RANGE
  if not low <= int(seed) <= high:
    raise ValueError(
        f"seed={seed!r} is outside the samplers' 32-bit seeds ({low}.."
        f"{high}), where seeds 2**32 apart write the same tokens: pass a "
        "seed in that range.")
  return int(seed)


def offset_seed(seed: int, by: int) -> int:
  """`seed + by`, wrapped into `SEED_RANGE` (a later window's seed)."""
  low, high = SEED_RANGE
  return (seed - low + by) % (high - low + 1) + low


def row_seeds(seed: tf.Tensor, rows: tf.Tensor, position: tf.Tensor
              ) -> tf.Tensor:
  """`(B, 2)` int32 stateless seeds, one per row, from (seed, row, position)."""
  rows = tf.cast(rows, tf.int32)
  position = tf.cast(position, tf.int32) + tf.zeros_like(rows)
  base = tf.stack([tf.cast(seed, tf.int32) + tf.zeros_like(rows), rows], -1)
  # Mixes in the position without collisions between (row, position) pairs.
  return tf.stack([base[:, 0] * 1000003 + position, base[:, 1]], -1)


_MASK = 0xFFFFFFFF


def _mix(x: tf.Tensor) -> tf.Tensor:
  """A 32-bit integer hash (Wellons' lowbias32), in int64 arithmetic
  that every TF and XLA kernel computes alike."""
  x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))
  x = (x * 0x21f0aaad) & _MASK
  x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))
  x = (x * 0x735a2d97) & _MASK
  return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))


def uniform(seeds: tf.Tensor, vocab: tf.Tensor) -> tf.Tensor:
  """`(B, vocab)` float32 in (0, 1): row `b` from its seed pair
  `seeds[b]`, entry `j` from the hash of (seed pair, `j`)."""
  seeds = tf.cast(seeds, tf.int64) & _MASK
  key = _mix(tf.bitwise.bitwise_xor(_mix(seeds[:, :1]), seeds[:, 1:]))
  j = tf.range(tf.cast(vocab, tf.int64), dtype=tf.int64)[None, :]
  bits = _mix(tf.bitwise.bitwise_xor(key, _mix(j + 0x9E3779B9)))
  return (tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) + 0.5) / (
      2.0 ** 24)


def _gumbel_choice(logits: tf.Tensor, seeds: tf.Tensor) -> tf.Tensor:
  """One draw per row from softmax(logits): the argmax of logits + Gumbel
  noise, each row's noise from its own seed."""
  u = uniform(seeds, tf.shape(logits)[-1])
  gumbel = -tf.math.log(-tf.math.log(u))
  return tf.argmax(logits + gumbel, axis=-1, output_type=tf.int32)


def _top_k_logits(logits: tf.Tensor, k: int) -> tf.Tensor:
  """Logits outside each row's `k` largest set to -inf."""
  k = min(k, logits.shape[-1])
  kth = tf.math.top_k(logits, k=k).values[:, -1:]
  return tf.where(logits < kth, tf.fill(tf.shape(logits), -float("inf")),
                  logits)


def _top_p_logits(logits: tf.Tensor, p: float) -> tf.Tensor:
  """Logits outside each row's nucleus (the most likely tokens whose
  probability first reaches `p`) set to -inf."""
  ranked = tf.sort(logits, axis=-1, direction="DESCENDING")
  before = tf.cumsum(tf.nn.softmax(ranked, axis=-1), axis=-1, exclusive=True)
  kept = tf.reduce_sum(tf.cast(before < p, tf.int32), -1)  # At least 1.
  cutoff = tf.gather(ranked, kept[:, None] - 1, batch_dims=1)
  return tf.where(logits < cutoff, tf.fill(tf.shape(logits), -float("inf")),
                  logits)


def next_tokens(logits: tf.Tensor, sampling: Sampling, seed: tf.Tensor,
                rows: tf.Tensor, position: tf.Tensor) -> tf.Tensor:
  """The chosen token of each row, `(B,)` int32.

  Args:
    logits: `(B, vocab)` scores of the next token.
    sampling: the sampler and its options.
    seed: a scalar int tensor (ignored by `greedy`).
    rows: `(B,)` each row's index in the whole request.
    position: the scalar position being filled.

  Returns:
    `(B,)` int32 token ids.
  """
  logits = tf.cast(logits, tf.float32)
  if sampling.sampler == "greedy":
    return tf.argmax(logits, axis=-1, output_type=tf.int32)
  logits = logits / float(sampling.temperature)
  if sampling.sampler == "top_k":
    logits = _top_k_logits(logits, sampling.k)
  elif sampling.sampler == "top_p":
    logits = _top_p_logits(logits, float(sampling.p))
  return _gumbel_choice(logits, row_seeds(seed, rows, position))
