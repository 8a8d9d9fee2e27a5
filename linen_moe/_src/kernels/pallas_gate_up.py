"""A gated MLP's gate and up projections as one Pallas call each way:
lhs [M, K] x (w0, w1) [G, K, N] -> (lhs @ w0, lhs @ w1), [M, N] each.

  forward  `gmm(lhs, (w0, w1))`                             two [M, N]
  dlhs     `gmm((d0, d1), (w0, w1), transpose_rhs=True)`    [M, K]
  dw0, dw1 `tgmm(lhs, (d0, d1))`                            [G, K, N] each

The forward and the weight gradients read each lhs tile once for both
weights; the input gradient sums the two contractions in the kernel's
float32 accumulator, where two calls would write two [M, K] gradients for
XLA to add (on a v5e, 2.4 ms of the 128-expert layer's 52:
benchmarks/device/README.md). The contract and
the checks are `pallas_grouped`'s, for both weights (one shape, one
dtype). Tiles are the single problem's (`gmm_tiling.choose_tiling`), with
smaller K tiles where the paired blocks would fill the VMEM
(`paired_tiling`), the VMEM limit raised for the second weight's blocks
where they need it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from linen_moe._src.kernels import gmm_tiling
from linen_moe._src.kernels import pallas_gmm
from linen_moe._src.kernels import pallas_grouped
from linen_moe._src.kernels.gmm_tiling import GmmTiling


def paired_vmem_bytes(tiling: GmmTiling, k: int, n: int, dtype) -> int:
  """VMEM of the paired calls' blocks with `tiling` (of [M, K] x [G, K, N]
  in `dtype`): the forward's (one lhs, two weights), the input gradient's
  (two of each) or the weight gradients' (two cotangents), the largest."""
  gmm = pallas_gmm.gmm_vmem_bytes(
      tiling.gmm, dtype, dtype, dtype, k // tiling.gmm[1], pairs=(1, 2)
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
  """The single problem's tiles (`gmm_tiling.choose_tiling`); while their
  paired blocks need more than half of the raised VMEM limit
  (`gmm_tiling.raised_vmem_limit`), each op's K tile the next smaller
  one. Then the VMEM limit they need.

  Measured on a v5e (benchmarks/device/bench_gate_up.py, forward +
  backward against two calls): at 8 experts of 2048 x 5632 (32,768 rows)
  the single problem's tiles need 80 MiB paired and run at 0.70x two
  calls' speed, with the K tiles one step smaller (45.5 MiB) at 1.03x; at
  128 experts of 2048 x 768 (131,072 rows) they need 45 MiB and run at
  1.30x (1.28x with smaller K tiles).
  """
  tiling = gmm_tiling.choose_tiling(m, k, n, g, dtype, chip)
  budget = gmm_tiling.raised_vmem_limit(chip) // 2
  while paired_vmem_bytes(tiling, k, n, dtype) > budget:
    (am, ak, an), (bm, bn, bk), (cm, ck, cn) = (
        tiling.gmm,
        tiling.gmm_t,
        tiling.tgmm,
    )
    smaller = [smaller_tile(t, k) for t in (ak, bk, ck)]
    if None in smaller:
      break
    ak, bk, ck = smaller
    tiling = dataclasses.replace(
        tiling, gmm=(am, ak, an), gmm_t=(bm, bn, bk), tgmm=(cm, ck, cn)
    )
  return with_paired_limit(tiling, k, n, dtype, chip)


def _run(tiling: GmmTiling, interpret: bool) -> dict:
  return dict(interpret=interpret, vmem_limit_bytes=tiling.vmem_limit_bytes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _paired(lhs, w0, w1, group_sizes, out_dtype, tiling, interpret):
  options = dict(tiling=tiling.gmm, out_dtype=out_dtype)
  return pallas_gmm.gmm(
      lhs, (w0, w1), group_sizes, **options, **_run(tiling, interpret)
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
  default tiles `paired_tiling`'s), in one call each way, with the VJP.

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
