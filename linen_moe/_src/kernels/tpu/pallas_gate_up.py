"""A gated MLP's gate and up projections, their backward as one Pallas call
each way: lhs [M, K] x (w0, w1) [G, K, N] -> (lhs @ w0, lhs @ w1), [M, N]
each.

  forward  `gmm(lhs, w0)`, `gmm(lhs, w1)`                   two [M, N]
  dlhs     `gmm((d0, d1), (w0, w1), transpose_rhs=True)`    [M, K]
  dw0, dw1 `tgmm(lhs, (d0, d1))`                            [G, K, N] each

The input gradient sums the two contractions in the kernel's float32
accumulator, where two calls would write two [M, K] gradients for XLA to
add (on a v5e, 2.4 ms of the 128-expert layer's 52); the weight gradients
read each lhs tile once for both. The forward stays two calls: one call
for both weights ran slower on a v5e wherever N spans several tiles
(`paired_tiling`). The contract and the checks are `pallas_grouped`'s, for
both weights (one shape, one dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.tpu import gmm_tiling
from linen_moe._src.kernels.tpu import pallas_gmm
from linen_moe._src.kernels.tpu import pallas_grouped
from linen_moe._src.kernels.tpu.gmm_tiling import GmmTiling


def paired_vmem_bytes(tiling: GmmTiling, k: int, n: int, dtype) -> int:
  """VMEM of the calls' blocks with `tiling` (of [M, K] x [G, K, N] in
  `dtype`): the forward's (one weight), the input gradient's (two of each
  operand) or the weight gradients' (two cotangents), the largest."""
  gmm = pallas_gmm.gmm_vmem_bytes(
      tiling.gmm, dtype, dtype, dtype, k // tiling.gmm[1]
  )
  gmm_t = pallas_gmm.gmm_vmem_bytes(
      tiling.gmm_t, dtype, dtype, dtype, n // tiling.gmm_t[1], pairs=(2, 2)
  )
  tgmm = pallas_gmm.tgmm_vmem_bytes(tiling.tgmm, dtype, dtype, dtype, 2)
  return max(gmm, gmm_t, tgmm)


def with_paired_limit(
    tiling: GmmTiling, k: int, n: int, dtype, chip: str | None
) -> GmmTiling:
  """`tiling` with the VMEM limit its paired blocks need
  (`gmm_tiling.vmem_limit`), where it sets none."""
  need = paired_vmem_bytes(tiling, k, n, dtype)
  limit = tiling.vmem_limit_bytes or gmm_tiling.vmem_limit(need, chip)
  return dataclasses.replace(tiling, vmem_limit_bytes=limit)


def smaller_tile(tile: int, size: int) -> int | None:
  """The largest multiple of 128 below `tile` that divides `size`; None if
  there is none."""
  return next((t for t in range(tile - 128, 127, -128) if size % t == 0), None)


def paired_tiling(
    m: int, k: int, n: int, g: int, dtype, chip: str | None
) -> GmmTiling:
  """The single problem's tiles (`gmm_tiling.choose_tiling`), the paired
  backward's K tiles (the input gradient's output, the weight gradients'
  contraction) one step smaller (`smaller_tile`); then the VMEM limit they
  need.

  Measured on a v5e (benchmarks/device/bench_gate_up.py, medians of 5,
  equal groups; ms of the two calls' forward + backward, then of the
  backward alone two calls / paired with these tiles / paired with the
  single problem's): 131,072 rows of 2048 x 768, 128 groups: 13.03; 7.66 /
  4.45 / 4.72. 32,768 of 2048 x 5632, 8 groups: 18.04; 8.53 / 7.28 /
  11.49. 32,768 of 4096 x 14336, 8 groups: 87.47; 46.42 / 22.17 / 30.24
  (there the single problem's tiles do not fit paired; 30.24 is with the
  weight gradient's K tile 1024, the input gradient's kept). The forward
  alone, two calls against one call for both weights: 5.37 / 5.32, 9.51 /
  14.45, 41.05 / 54.78 ms; so it stays two calls.
  """
  tiling = gmm_tiling.choose_tiling(m, k, n, g, dtype, chip)
  (bm, bn, bk), (cm, ck, cn) = tiling.gmm_t, tiling.tgmm
  tiling = dataclasses.replace(
      tiling,
      gmm_t=(bm, bn, smaller_tile(bk, k) or bk),
      tgmm=(cm, smaller_tile(ck, k) or ck, cn),
  )
  return with_paired_limit(tiling, k, n, dtype, chip)


def _run(tiling: GmmTiling, interpret: bool) -> dict:
  return dict(interpret=interpret, vmem_limit_bytes=tiling.vmem_limit_bytes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _paired(lhs, w0, w1, group_sizes, out_dtype, tiling, interpret):
  options = dict(tiling=tiling.gmm, out_dtype=out_dtype)
  return tuple(
      pallas_gmm.gmm(lhs, w, group_sizes, **options, **_run(tiling, interpret))
      for w in (w0, w1)
  )


def _paired_fwd(lhs, w0, w1, group_sizes, out_dtype, tiling, interpret):
  out = _paired(lhs, w0, w1, group_sizes, out_dtype, tiling, interpret)
  return out, (lhs, w0, w1, group_sizes)


def _paired_bwd(out_dtype, tiling, interpret, residuals, douts):
  del out_dtype
  lhs, w0, w1, group_sizes = residuals
  d0, d1 = douts
  run = _run(tiling, interpret)
  dlhs = pallas_gmm.gmm(
      (d0, d1),
      (w0, w1),
      group_sizes,
      tiling=tiling.gmm_t,
      out_dtype=lhs.dtype,
      transpose_rhs=True,
      **run,
  )
  dw0, dw1 = pallas_gmm.tgmm(
      lhs, (d0, d1), group_sizes, tiling=tiling.tgmm, out_dtype=w0.dtype, **run
  )
  return dlhs, dw0, dw1, None


_paired.defvjp(_paired_fwd, _paired_bwd)


def paired_grouped_matmul(
    lhs: jax.Array,
    w0: jax.Array,
    w1: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    *,
    tiling: GmmTiling | None = None,
    interpret: bool = False,
    chip: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(lhs @ w0, lhs @ w1) by group, as `pallas_grouped.pallas_grouped_matmul`
  makes each (the same arguments, two weights of one shape and dtype; the
  default tiles `paired_tiling`'s), the forward as two calls, the backward
  as one call each way.

  Returns:
    two [M, N]; rows past sum(group_sizes) are zeros. Gradients: lhs [M, K]
    in its dtype (the sum of both contractions, zeros past
    sum(group_sizes)), w0 and w1 [G, K, N] in their dtype.

  Raises:
    ValueError: shapes that do not fit (`pallas_grouped`'s checks), or w0
      and w1 of different shapes.
    TypeError: a dtype the kernels do not take, or w0 and w1 of different
      dtypes.
  """
  if w0.shape != w1.shape:
    raise ValueError(
        f"w0 and w1 must have one shape; got {w0.shape} and {w1.shape}."
    )
  if w0.dtype != w1.dtype:
    raise TypeError(
        f"w0 and w1 must have one dtype; got {w0.dtype} and {w1.dtype}."
    )
  out_dtype = pallas_grouped.check_operands(
      lhs, w0, group_sizes, preferred_element_type
  )
  (m, k), (g, _, n) = lhs.shape, w0.shape
  pallas_grouped.check_group_sizes(group_sizes, m)
  if min(m, k, n, g) == 0:
    zeros = jnp.zeros((m, n), out_dtype)
    return zeros, zeros
  if tiling is None:
    dtype = pallas_gmm.compute_dtype(lhs.dtype, w0.dtype)
    chip = chip or gmm_tiling.current_chip()
    tiling = paired_tiling(m, k, n, g, dtype, chip)
  pallas_grouped.check_tiling(tiling, k, n)
  sizes = group_sizes.astype(jnp.int32)
  return _paired(lhs, w0, w1, sizes, out_dtype, tiling, interpret)
