"""Synthetic token data with a known, learnable structure.

Tokens follow a fixed first-order Markov chain: each token has `branching`
equally likely successors, drawn once from a seeded table. A model that learns
the table reaches a next-token cross-entropy of exactly `log(branching)` nats,
the best achievable loss, while an untrained one sits near `log(vocab_size)`.
"""

from __future__ import annotations

import dataclasses
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

  @property
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

  def batches(self, batch_size: int, seq_len: int, seed: int = 1):
    """Yields an endless stream of <int32>[batch_size, seq_len] batches."""
    table = self.successors
    rng = np.random.default_rng(seed)
    while True:
      tokens = np.empty((batch_size, seq_len), np.int32)
      tokens[:, 0] = rng.integers(0, self.vocab_size, batch_size)
      choices = rng.integers(0, self.branching, (batch_size, seq_len))
      for t in range(1, seq_len):
        tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
      yield tokens
