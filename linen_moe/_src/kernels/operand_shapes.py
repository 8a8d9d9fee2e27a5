"""The grouped matmul's operand shapes, checked once for every
implementation: lhs [M, K], rhs [G, K, N], group_sizes [G]. Imports no
flax (the Pallas kernels check with it where only jax is installed)."""

from __future__ import annotations


def check_shapes(lhs, rhs, group_sizes) -> None:
  """Raises a `ValueError` naming the first operand whose shape does not
  fit lhs [M, K] x rhs [G, K, N] with group_sizes [G]."""
  if lhs.ndim != 2:
    raise ValueError(f"lhs [M, K] must have rank 2; got shape {lhs.shape}.")
  if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
    raise ValueError(
        "rhs [G, K, N] must have rank 3 and the same K as lhs (lhs.shape[1] = "
        f"{lhs.shape[1]}); got shape {rhs.shape}."
    )
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(
        f"group_sizes must have shape [G] = ({rhs.shape[0]},), one size per "
        f"group of rhs; got shape {group_sizes.shape}."
    )
