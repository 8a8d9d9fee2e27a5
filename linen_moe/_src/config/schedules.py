"""The learning-rate schedules' names and default, without jax (a run's
options are checked before jax loads; `linen_moe._src.training.optimizer`
builds the schedules)."""

from __future__ import annotations

SCHEDULES = ("constant", "cosine", "linear")
# `final_lr_ratio` of "cosine" and "linear" when none is given.
DEFAULT_FINAL_LR_RATIO = 0.1
