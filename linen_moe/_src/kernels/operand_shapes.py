"""The grouped matmul's operand checks, shared by every implementation and
every kernel of every backend: lhs [M, K], rhs [G, K, N], group_sizes [G]
(`check_shapes`), the operand dtypes a kernel takes (`check_dtypes`), and
concrete group sizes (`check_group_sizes`). Each runs before any work and
raises one error naming the argument, its value and what is allowed.
Imports no flax (the Pallas kernels check with it where only jax is
installed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


def _names(dtypes) -> str:
  return ", ".join(jnp.dtype(d).name for d in dtypes)


def check_dtypes(
    lhs,
    rhs,
    group_sizes,
    preferred_element_type,
    allowed: Sequence[Any],
    kernel: str,
) -> jnp.dtype:
  """Checks the dtypes `kernel` (a name, for the message) takes; returns
  the output dtype (`preferred_element_type`, default the operands' result
  type), which must be one of `allowed` too.

  Raises:
    TypeError: non-integer group sizes, or an operand or output dtype
      outside `allowed`.
  """
  allowed = tuple(jnp.dtype(d) for d in allowed)
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(
        f"group_sizes must be integers; got dtype {group_sizes.dtype}."
    )
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if jnp.dtype(x.dtype) not in allowed:
      raise TypeError(
          f"{name} has dtype {x.dtype}; {kernel} takes {_names(allowed)}."
      )
  out = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  if jnp.dtype(out) not in allowed:
    raise TypeError(
        f"preferred_element_type={jnp.dtype(out).name}; {kernel} writes "
        f"{_names(allowed)}."
    )
  return jnp.dtype(out)


def check_group_sizes(group_sizes, m: int) -> None:
  """Concrete group sizes: none negative, summing to at most M. Traced
  ones pass unchecked (under `jit` they are values, not known at trace
  time: negative ones count as 0 and rows past M are dropped, as
  `jax.lax.ragged_dot` does).

  Raises:
    ValueError: a negative size, or a sum past M.
  """
  if isinstance(group_sizes, jax.core.Tracer):
    return
  sizes = np.asarray(group_sizes)
  if np.any(sizes < 0):
    raise ValueError(
        f"group_sizes must be >= 0; got {sizes.tolist()} (negative at "
        f"{np.flatnonzero(sizes < 0).tolist()})."
    )
  if int(sizes.sum()) > m:
    raise ValueError(
        f"group_sizes sum to {int(sizes.sum())}, past the {m} rows of lhs; "
        "allowed: at most M."
    )
