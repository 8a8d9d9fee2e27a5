"""What a training run did: `RunResult`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Steps over which the final loss and expert loads are averaged.
TAIL_STEPS = 10


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What a run did: the steps this call ran (none when a resumed run was
  already at its `steps`).

  Attributes:
    losses: per-step cross-entropy of steps `start_step + 1` onwards (NaN
      where the step was skipped).
    best_loss: the best achievable loss (the synthetic data's; NaN for real
      data).
    skipped_steps: how many steps were skipped.
    expert_load: <float32>[L, E] each layer's share of routed assignments
      per expert, averaged over the last `TAIL_STEPS` steps.
    start_step: the step the run started from (0, or the resumed one).
    eval_losses: the held-out losses [(step, nats)] of the evaluated steps
      (`eval_every`).
    stop_reason: why a callback stopped the run early (`RunInfo.stop`),
      or None.
  """

  losses: list[float]
  best_loss: float
  skipped_steps: int = 0
  expert_load: np.ndarray | None = None
  start_step: int = 0
  eval_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  stop_reason: str | None = None

  @property
  def first_loss(self) -> float:
    return next((x for x in self.losses if math.isfinite(x)), math.nan)

  @property
  def final_loss(self) -> float:
    """Mean of the last `TAIL_STEPS` (10) steps' finite losses (less noisy
    than the last one); `linen-moe train` prints it so labelled."""
    tail = [x for x in self.losses[-TAIL_STEPS:] if math.isfinite(x)]
    return sum(tail) / len(tail) if tail else math.nan

  @property
  def load_ratio(self) -> float:
    """Max / min expert load of the most unbalanced layer (1 = balanced; inf
    when an expert got nothing), from `expert_load`."""
    load = self.expert_load[self.expert_load.sum(axis=-1) > 0]  # MoE layers
    with np.errstate(divide="ignore"):
      ratios = load.max(axis=-1) / load.min(axis=-1)
    return float(np.max(ratios))
