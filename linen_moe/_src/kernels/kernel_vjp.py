"""The gradients of a grouped matmul made of kernel passes, shared by our
Pallas kernels (TPU and Pallas-Triton): lhs [M, K] x rhs [G, K, N] -> [M, N]
and its VJP from the same kernels.

  forward  pass "gmm"    (lhs, rhs)   [M, N]
  dlhs     pass "gmm_t"  (dout, rhs)  [M, K]  (rhs transposed)
  drhs     pass "tgmm"   (lhs, dout)  [G, K, N]

A kernel module gives one function `run_pass(op, a, b, group_sizes, tiling,
out_dtype, interpret)` that runs its kernel for the pass named `op` with
that pass's tiles of `tiling`; `with_vjp` makes the differentiable matmul.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax

# op, a, b, group_sizes, tiling, out_dtype, interpret -> the pass's output
RunPass = Callable[..., jax.Array]


def with_vjp(run_pass: RunPass) -> Callable[..., jax.Array]:
  """f(lhs, rhs, group_sizes, out_dtype, tiling, interpret) -> [M, N] with
  a custom VJP: dlhs in lhs's dtype, drhs in rhs's dtype, none for the
  group sizes. `out_dtype`, `tiling` and `interpret` must be hashable (they
  are static)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
  def gmm(lhs, rhs, group_sizes, out_dtype, tiling: Any, interpret: bool):
    return run_pass("gmm", lhs, rhs, group_sizes, tiling, out_dtype, interpret)

  def fwd(lhs, rhs, group_sizes, out_dtype, tiling, interpret):
    out = gmm(lhs, rhs, group_sizes, out_dtype, tiling, interpret)
    return out, (lhs, rhs, group_sizes)

  def bwd(out_dtype, tiling, interpret, residuals, dout):
    del out_dtype
    lhs, rhs, group_sizes = residuals
    dlhs = run_pass(
        "gmm_t", dout, rhs, group_sizes, tiling, lhs.dtype, interpret
    )
    drhs = run_pass(
        "tgmm", lhs, dout, group_sizes, tiling, rhs.dtype, interpret
    )
    return dlhs, drhs, None

  gmm.defvjp(fwd, bwd)
  return gmm
