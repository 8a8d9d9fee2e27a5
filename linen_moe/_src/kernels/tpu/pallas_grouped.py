"""The Pallas TPU grouped matmul with its gradients: lhs [M, K] x rhs
[G, K, N] -> [M, N], the contract of `grouped_matmul` (rows sorted by group,
rows past sum(group_sizes) zero, and so are their input gradients).

  forward  `pallas_gmm.gmm(lhs, rhs)`                       [M, N]
  dlhs     `pallas_gmm.gmm(dout, rhs, transpose_rhs=True)`  [M, K]
  drhs     `pallas_gmm.tgmm(lhs, dout)`                     [G, K, N]

Every check runs before any work, at trace time, and each raises one error
naming the argument, its value and what is allowed: ranks and shapes,
operand dtypes (float32 / bfloat16: a `TypeError`), tiles (`GmmTiling`: rows
a multiple of 16; K and N tiles dividing K and N, multiples of 128 or the
whole dimension), and, when they are concrete (not traced), group sizes
that are negative or sum past M. Traced sizes cannot be checked: negative
ones count as 0 and rows past M are dropped, as `jax.lax.ragged_dot` does.

Tiles come from `gmm_tiling.choose_tiling` (the measured table, else its
rule) unless given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linen_moe._src.kernels import kernel_vjp
from linen_moe._src.kernels.operand_shapes import check_dtypes
from linen_moe._src.kernels.operand_shapes import check_group_sizes
from linen_moe._src.kernels.operand_shapes import check_shapes
from linen_moe._src.kernels.tpu import gmm_tiling
from linen_moe._src.kernels.tpu import pallas_gmm
from linen_moe._src.kernels.tpu.gmm_tiling import GmmTiling

OPERAND_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_operands(lhs, rhs, group_sizes, preferred_element_type) -> jnp.dtype:
  """Checks ranks, shapes and dtypes; returns the output dtype.

  Raises:
    ValueError: a rank or shape that does not fit.
    TypeError: a dtype the kernel does not take.
  """
  check_shapes(lhs, rhs, group_sizes)
  return check_dtypes(
      lhs,
      rhs,
      group_sizes,
      preferred_element_type,
      OPERAND_DTYPES,
      "the Pallas grouped matmul",
  )


def _check_tiles(op: str, tiles, c: int, o: int, multiple: int) -> None:
  names = ("rows", "contraction", "output")
  if (
      not isinstance(tiles, tuple)
      or len(tiles) != 3
      or not all(isinstance(t, int) and t > 0 for t in tiles)
  ):
    raise ValueError(
        f"tiling.{op} must be 3 positive ints ({', '.join(names)}); got "
        f"{tiles!r}."
    )
  if tiles[0] % multiple:
    raise ValueError(
        f"tiling.{op} row tile {tiles[0]} must be a multiple of {multiple}."
    )
  for name, t, d in zip(names[1:], tiles[1:], (c, o), strict=True):
    if d % t or (t != d and t % 128):
      raise ValueError(
          f"tiling.{op} {name} tile {t} must divide {d} and be a multiple "
          f"of 128 or {d} itself."
      )


def check_tiling(
    tiling: GmmTiling, k: int, n: int, ops=gmm_tiling.OPS, multiple: int = 16
) -> None:
  """Checks `ops`' tiles against lhs [M, K] x [G, K, N].

  Raises:
    ValueError: a tile that is not 3 positive ints, a row tile that is no
      multiple of `multiple` (`gmm_tiling.row_multiple`), or a column tile
      that does not divide its dimension (or is neither a multiple of 128
      nor the whole dimension).
  """
  if not isinstance(tiling, GmmTiling):
    raise ValueError(f"tiling must be a GmmTiling or None; got {tiling!r}.")
  dims = {"gmm": (k, n), "gmm_t": (n, k), "tgmm": (k, n)}
  for op in ops:
    _check_tiles(op, getattr(tiling, op), *dims[op], multiple)


def _run_pass(op, a, b, group_sizes, tiling, out_dtype, interpret):
  """One pass of `kernel_vjp.with_vjp` with its tiles of `tiling`."""
  run = dict(
      tiling=getattr(tiling, op),
      out_dtype=out_dtype,
      interpret=interpret,
      vmem_limit_bytes=tiling.vmem_limit_bytes,
  )
  if op == "tgmm":
    return pallas_gmm.tgmm(a, b, group_sizes, **run)
  return pallas_gmm.gmm(a, b, group_sizes, transpose_rhs=op == "gmm_t", **run)


_gmm = kernel_vjp.with_vjp(_run_pass)


def pallas_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    *,
    tiling: GmmTiling | None = None,
    interpret: bool = False,
    chip: str | None = None,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N] with the Pallas kernels and their VJP.

  Args:
    lhs: [M, K] float32 or bfloat16, rows sorted by group.
    rhs: [G, K, N] float32 or bfloat16.
    group_sizes: <int>[G], rows per group (sum <= M).
    preferred_element_type: the output dtype (float32 or bfloat16); default
      the operands' result type. Accumulation is float32 regardless.
    tiling: the tiles; default `gmm_tiling.choose_tiling` for `chip`.
    interpret: run the kernels in Pallas interpret mode (any backend).
    chip: the TPU whose tiles to use ("v5e", ...); default the one traced
      for (`gmm_tiling.current_chip`).

  Returns:
    [M, N]; rows past sum(group_sizes) are zeros. Gradients: dlhs [M, K] in
    lhs's dtype (zeros past sum(group_sizes)), drhs [G, K, N] in rhs's
    dtype (zeros for empty groups).

  Raises:
    ValueError, TypeError: see the module docstring.
  """
  out_dtype = check_operands(lhs, rhs, group_sizes, preferred_element_type)
  (m, k), (g, _, n) = lhs.shape, rhs.shape
  check_group_sizes(group_sizes, m)
  if tiling is None and min(m, k, n, g) > 0:
    dtype = pallas_gmm.compute_dtype(lhs.dtype, rhs.dtype)
    chip = chip or gmm_tiling.current_chip()
    tiling = gmm_tiling.choose_tiling(m, k, n, g, dtype, chip)
  if tiling is not None:
    check_tiling(tiling, k, n)
  if min(m, k, n, g) == 0:
    return jnp.zeros((m, n), out_dtype)
  return _gmm(
      lhs, rhs, group_sizes.astype(jnp.int32), out_dtype, tiling, interpret
  )
