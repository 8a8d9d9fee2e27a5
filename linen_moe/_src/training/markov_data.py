"""Synthetic token data with a known, learnable structure.

Tokens follow a fixed first-order Markov chain: each token has `branching`
equally likely successors, drawn once from a seeded table. A model that learns
the table reaches a next-token cross-entropy of exactly `log(branching)` nats,
the best achievable loss, while an untrained one sits near `log(vocab_size)`.

Batch `step` of a stream is a pure function of (seed, step), so the position
in the data is just the step: a run resumed at step N sees the batches the
uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class MarkovData:
  """Batches of <int32>[batch, seq] tokens from a seeded Markov chain.

  Attributes:
    vocab_size: V.
    branching: successors per token (1 <= branching <= V).
    seed: seed of the transition table (the "language").
  """

  vocab_size: int
  branching: int = 4
  seed: int = 0

  def __post_init__(self):
    if not 1 <= self.branching <= self.vocab_size:
      raise ValueError(
          f"MarkovData.branching={self.branching} must be in "
          f"[1, vocab_size={self.vocab_size}]."
      )

  @functools.cached_property
  def successors(self) -> np.ndarray:
    """<int32>[V, branching]: the allowed next tokens of each token."""
    rng = np.random.default_rng(self.seed)
    table = [
        rng.choice(self.vocab_size, self.branching, replace=False)
        for _ in range(self.vocab_size)
    ]
    return np.asarray(table, np.int32)

  @property
  def best_loss(self) -> float:
    """The entropy of one transition, in nats: the lowest reachable loss."""
    return math.log(self.branching)

  def batch(
      self, step: int, batch_size: int, seq_len: int, seed: int = 1
  ) -> np.ndarray:
    """One batch of the stream, drawn from a generator seeded with (seed,
    step) alone (so any batch is drawn without the ones before it).

    Args:
      step: the batch's index in the stream, >= 0.
      batch_size: B, rows.
      seq_len: S, tokens per row.
      seed: the stream, >= 0.

    Returns:
      <int32>[B, S] token ids in [0, vocab_size), each row a walk of the
      chain from a uniform first token.

    Raises:
      TypeError: if `step` or `seed` is not an int.
      ValueError: if either is negative.
    """
    for name, value in (("step", step), ("seed", seed)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"MarkovData.batch: {name}={value!r} is not an int.")
      if value < 0:
        raise ValueError(f"MarkovData.batch: {name}={value} must be >= 0.")
    table = self.successors
    rng = np.random.default_rng((seed, step))
    tokens = np.empty((batch_size, seq_len), np.int32)
    tokens[:, 0] = rng.integers(0, self.vocab_size, batch_size)
    choices = rng.integers(0, self.branching, (batch_size, seq_len))
    for t in range(1, seq_len):
      tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
    return tokens

  def batches(self, batch_size: int, seq_len: int, seed: int = 1, start=0):
    """The batches of a stream from `start` on, without end.

    Args:
      batch_size: B, rows.
      seq_len: S, tokens per row.
      seed: the stream, >= 0.
      start: the first batch's index.

    Yields:
      <int32>[B, S] each, `batch(start, ...)`, `batch(start + 1, ...)`, ...
    """
    step = start
    while True:
      yield self.batch(step, batch_size, seq_len, seed)
      step += 1
