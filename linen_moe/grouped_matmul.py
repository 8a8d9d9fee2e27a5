"""Grouped matmul: rows of `lhs`, sorted by group, times their group's matrix.

  out[i] = lhs[i] @ rhs[g(i)]   for rows i of group g(i), i < sum(group_sizes)
  out[i] = 0                    for the rows past sum(group_sizes)

Shapes: lhs [M, K], rhs [G, K, N], group_sizes <int32>[G] -> [M, N].
Knows nothing of MoE or quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "ragged_dot", "blocked", "kernel")


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
) -> jax.Array:
  """XLA's `jax.lax.ragged_dot`: the reference implementation."""
  return jax.lax.ragged_dot(
      lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type=preferred_element_type,
  )


def resolve_implementation(implementation: str) -> str:
  """Maps "auto" to the fastest implementation available on this backend."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"Unknown grouped matmul implementation {implementation!r}; allowed: "
        f"{IMPLEMENTATIONS}."
    )
  if implementation == "auto":
    return "ragged_dot"
  return implementation


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: str = "auto",
    preferred_element_type=None,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N]; see the module docstring."""
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
        "grouped_matmul expects lhs [M, K] and rhs [G, K, N]; got "
        f"{lhs.shape} and {rhs.shape}."
    )
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(
        f"group_sizes must have shape [G]=({rhs.shape[0]},); got "
        f"{group_sizes.shape}."
    )
  impl = resolve_implementation(implementation)
  if impl == "ragged_dot":
    return ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  raise NotImplementedError(f"grouped matmul implementation {impl!r}")
