"""The int8 grouped matmul on the Pallas kernels: int8 operands straight into
the MXU, int32 accumulation, the scales applied in the kernel's epilogue.

  q_lhs <int8>[M, C] x q_rhs <int8>[G, C, O] -> <float32>[M, O]
  out[r] = float32(q_lhs[r] @ q_rhs[g(r)]) * lhs_scale[r] * rhs_scale[g(r)]

with `transpose_rhs` the rhs is <int8>[G, O, C] (the input gradient's
contraction, without a transposed copy of the weights). This is the
forward and the input gradient of `int8_grouped` (AQT's int8 numerics:
the same int32 sums and the same float32 products in the same order as its
`jax.lax.ragged_dot` path, so the two agree bit for bit); it has no VJP of
its own (`int8_grouped` brings it). Rows past sum(group_sizes) are zeros.
Knows nothing of quantization beyond its operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.operand_shapes import check_shapes
from linen_moe._src.kernels.tpu import gmm_tiling
from linen_moe._src.kernels.tpu import pallas_gmm
from linen_moe._src.kernels.tpu import pallas_grouped
from linen_moe._src.kernels.tpu.gmm_tiling import GmmTiling


def _check(q_lhs, lhs_scale, q_rhs, rhs_scale, group_sizes, transpose_rhs):
  """Raises a `TypeError` for operands that are not int8 or scales that are
  not float32, a `ValueError` for shapes that do not fit."""
  shape = q_rhs.shape  # as [G, C, O]
  if transpose_rhs and q_rhs.ndim == 3:
    shape = (shape[0], shape[2], shape[1])
  rhs_view = jax.ShapeDtypeStruct(shape, q_rhs.dtype)
  check_shapes(q_lhs, rhs_view, group_sizes)
  for name, x, want in (
      ("q_lhs", q_lhs, jnp.int8),
      ("q_rhs", q_rhs, jnp.int8),
      ("lhs_scale", lhs_scale, jnp.float32),
      ("rhs_scale", rhs_scale, jnp.float32),
  ):
    if x.dtype != want:
      raise TypeError(
          f"{name} has dtype {x.dtype}; the int8 Pallas grouped matmul takes "
          f"{jnp.dtype(want).name}."
      )
  m, (g, _, o) = q_lhs.shape[0], rhs_view.shape
  for name, x, want in (
      ("lhs_scale", lhs_scale, (m, 1)),
      ("rhs_scale", rhs_scale, (g, 1, o)),
  ):
    if x.shape != want:
      raise ValueError(
          f"{name} must have shape {want} (one scale per "
          f"{'row' if name == 'lhs_scale' else 'group and output column'});"
          f" got {x.shape}."
      )


def int8_grouped_matmul_scaled(
    q_lhs: jax.Array,
    lhs_scale: jax.Array,
    q_rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    tiling: GmmTiling | None = None,
    interpret: bool = False,
    chip: str | None = None,
) -> jax.Array:
  """<int8>[M, C] x <int8>[G, C, O] -> <float32>[M, O], scaled in-kernel.

  Args:
    q_lhs: <int8>[M, C], rows sorted by group.
    lhs_scale: <float32>[M, 1], one scale per row.
    q_rhs: <int8>[G, C, O], or [G, O, C] when `transpose_rhs`.
    rhs_scale: <float32>[G, 1, O], one scale per group and output column.
    group_sizes: <int>[G] (sum <= M; concrete sizes are checked).
    transpose_rhs: contract q_rhs's last dimension.
    tiling: the tiles (its `gmm`, or `gmm_t` when `transpose_rhs`, for rhs
      [G, K, N] = q_rhs's shape); default `gmm_tiling.choose_tiling` for
      int8 on `chip`.
    interpret: run the kernel in Pallas interpret mode (any backend).
    chip: the TPU whose tiles to use; default the one traced for.

  Returns:
    <float32>[M, O]; rows past sum(group_sizes) are zeros.

  Raises:
    TypeError, ValueError: operands, scales, sizes or tiles that do not fit.
  """
  _check(q_lhs, lhs_scale, q_rhs, rhs_scale, group_sizes, transpose_rhs)
  m = q_lhs.shape[0]
  pallas_grouped.check_group_sizes(group_sizes, m)
  g, k, n = q_rhs.shape
  op = "gmm_t" if transpose_rhs else "gmm"
  if tiling is None and min(m, k, n, g) > 0:
    chip = chip or gmm_tiling.current_chip()
    tiling = gmm_tiling.choose_tiling(m, k, n, g, jnp.int8, chip)
  if tiling is not None:
    multiple = gmm_tiling.row_multiple(jnp.int8)
    pallas_grouped.check_tiling(tiling, k, n, (op,), multiple)
  o = k if transpose_rhs else n
  if min(m, k, n, g) == 0:
    return jnp.zeros((m, o), jnp.float32)
  return pallas_gmm.gmm(
      q_lhs,
      q_rhs,
      group_sizes.astype(jnp.int32),
      tiling=getattr(tiling, op),
      out_dtype=jnp.float32,
      transpose_rhs=transpose_rhs,
      interpret=interpret,
      vmem_limit_bytes=tiling.vmem_limit_bytes,
      scales=(lhs_scale, rhs_scale),
  )
