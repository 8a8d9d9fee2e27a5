"""Contraction modules, one per quantization mode. Knows nothing of MoE.

Each mode offers two Linen modules with the same call signature across modes:

  einsum module:          module(eqn, lhs, rhs) -> einsum(eqn, lhs, rhs)
  grouped matmul module:  module(lhs [M, K], rhs [G, K, N], group_sizes [G])

`contraction_modules(mode)` is the one factory that picks them. Quantization
state never lives in `params`, so one `params` tree loads into every mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe import grouped_matmul as gmm_lib
from linen_moe.config import QUANTIZATIONS

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class Einsum(nn.Module):
  """Unquantized einsum in the dtype of its operands."""

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    return jnp.einsum(eqn, lhs, rhs)


class GroupedMatmul(nn.Module):
  """Unquantized grouped matmul.

  Attributes:
    implementation: see `linen_moe.grouped_matmul.IMPLEMENTATIONS`.
  """

  implementation: str = "auto"

  @nn.compact
  def __call__(
      self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array
  ) -> jax.Array:
    return gmm_lib.grouped_matmul(
        lhs, rhs, group_sizes, implementation=self.implementation
    )


@dataclasses.dataclass(frozen=True)
class ContractionModules:
  """The Linen module classes a quantization mode contracts with."""

  einsum: type[nn.Module]
  grouped_matmul: type[nn.Module]
  einsum_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  grouped_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def contraction_modules(mode: str, **options: Any) -> ContractionModules:
  """The one factory: einsum and grouped-matmul module classes for `mode`.

  Options: `implementation` (grouped matmul), `amax_history_length` (fp8).
  """
  if mode not in QUANTIZATIONS:
    raise ValueError(
        f"Unknown quantization {mode!r}; allowed: {QUANTIZATIONS}."
    )
  implementation = options.get("implementation", "auto")
  if mode == "none":
    return ContractionModules(
        Einsum, GroupedMatmul, grouped_kwargs={"implementation": implementation}
    )
  raise NotImplementedError(f"quantization {mode!r} is not implemented yet")
