"""The LoRA config: rank, alpha, targets, dropout. No jax at import.

`MoEConfig` holds it as flat fields (`lora_rank`, `lora_alpha`,
`lora_targets`, `lora_dropout`: a checkpoint's run fields and the YAML
files stay flat), and `MoEConfig.lora` returns it as a `LoRAConfig`, or None
when `lora_rank` is 0 (no adapters).
"""

from __future__ import annotations

import dataclasses
import math

# What adapters may sit on, each a set of kernels:
#   experts    the routed experts' wi_0, wi_1, wo ([E, M, H], [E, H, M])
#   shared     the shared experts' wi_0, wi_1, wo
#   mlp        the dense layers' MLP (wi_0, wi_1, wo)
#   attention  every attention projection (query, key, value, out; MLA's
#              query_a, query_b, kv_a, kv_b, out)
TARGETS = ("experts", "shared", "mlp", "attention")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters: kernel W [K, N] -> W + (alpha / rank) A B, A [K, r],
  B [r, N] (per expert: A [E, K, r], B [E, r, N]), B initialised to 0.

  Example usage:
    cfg = load_model_config("tiny_qwen3_moe").replace(lora_rank=8)
    cfg.moe.lora  # LoRAConfig(rank=8, alpha=8.0, targets=TARGETS, ...)

  Attributes:
    rank: r >= 1.
    alpha: the scale's numerator; the delta is multiplied by alpha / rank
      (0 = rank, a scale of 1).
    targets: a non-empty subset of `TARGETS`.
    dropout: the dropout rate on the adapter's input (0 <= p < 1; applied
      only when `apply` gets an RNG in the "params" stream, as a train
      step's `rng_dict` gives it; without one, e.g. evaluating, none).
  """

  rank: int
  alpha: float = 0.0
  targets: tuple[str, ...] = TARGETS
  dropout: float = 0.0

  def __post_init__(self):
    check(self.rank, self.alpha, self.targets, self.dropout)
    object.__setattr__(self, "alpha", float(self.alpha or self.rank))
    object.__setattr__(self, "targets", tuple(self.targets))

  @property
  def scale(self) -> float:
    """alpha / rank, the multiplier of the adapter's delta."""
    return self.alpha / self.rank


def check(
    rank, alpha, targets, dropout, cls: str = "LoRAConfig", prefix: str = ""
) -> None:
  """Validates the four LoRA fields; an error names `{cls}.{prefix}field`,
  its value and what is allowed."""

  def fail(field, value, allowed):
    raise ValueError(f"{cls}.{prefix}{field}={value!r} is invalid: {allowed}.")

  if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
    fail("rank", rank, "an integer >= 1")
  if (
      isinstance(alpha, bool)
      or not isinstance(alpha, (int, float))
      or not math.isfinite(alpha)
      or alpha < 0
  ):
    fail("alpha", alpha, "a finite number >= 0 (0 = rank)")
  if isinstance(targets, str) or not isinstance(targets, (tuple, list)):
    fail("targets", targets, f"a tuple of names from {TARGETS}")
  unknown = [t for t in targets if t not in TARGETS]
  if unknown or not targets or len(set(targets)) != len(targets):
    fail(
        "targets",
        tuple(targets),
        f"a non-empty tuple of distinct names from {TARGETS}"
        + (f" (unknown: {unknown})" if unknown else ""),
    )
  if (
      isinstance(dropout, bool)
      or not isinstance(dropout, (int, float))
      or not 0 <= dropout < 1
  ):
    fail("dropout", dropout, "a number in [0, 1)")


def check_rank(rank: int, kernels: dict[str, tuple[int, int]], cls: str):
  """rank <= min(K, N) of every adapted kernel {where: (K, N)}; else a
  ValueError naming `{cls}.lora_rank`."""
  for where, (k, n) in kernels.items():
    if rank > min(k, n):
      raise ValueError(
          f"{cls}.lora_rank={rank} is invalid: it must be <= the smaller "
          f"side of every adapted kernel, and {where} is [{k}, {n}] (a rank "
          f"above {min(k, n)} adds parameters but no expressiveness)."
      )
