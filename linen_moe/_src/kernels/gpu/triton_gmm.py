"""Our Pallas grouped matmul for NVIDIA GPUs (Pallas' Triton backend),
forward and weight gradient; the kernels only (`triton_grouped` wraps them
with their checks and VJP).

  gmm   lhs [M, C] x rhs [G, C, O] -> [M, O]: each row times its group's
        matrix (`transpose_rhs`: rhs [G, O, C], each row times its
        transpose: the input gradient's contraction).
  tgmm  lhs [M, K], dout [M, N] -> [G, K, N]: per group, the sum over its
        rows of lhs[r]^T dout[r] (the weight gradient).

`gmm` works on *work items* (`work_items`): the rows [0, M) cut into
segments, one per group and one more, the *tail*, for the rows past
sum(group_sizes); an item is one (segment, row tile) pair whose rows meet.
A row tile that straddles a group boundary is an item per group, each
multiplying the whole tile and storing only its segment's rows (a masked
store), so every row of the output is written by exactly one program and
no group is padded to whole tiles beyond the tiles that straddle. A tail
item stores zeros without a matmul. The items are the TPU kernels' visit
schedule (`tpu.gmm_schedule`, pure jnp) with the tail as one more group:
at most cdiv(M, block_m) + G of them; the grid holds that many (Triton's
grid is static) and the programs past the real count return at once.

`tgmm` runs one program per (group, K tile, N tile), looping over the
group's rows in steps of block_m from its first row (not tile-aligned):
an empty group's program stores zeros, a one-row group's loops once.

Programs are numbered in one grid dimension (Triton's first has no
65,535 limit). `gmm` maps them to (item, column tile) in windows of
`group_m` items (the Triton matmul tutorial's L2 ordering: the programs
resident together share a few lhs tiles and a few rhs column blocks);
`tgmm` runs a group's programs together, N tiles fastest (they share the
group's lhs rows).

Operands are float16, bfloat16 or float32; the product runs in their
type when both are bfloat16 (or both float16), else in float32 at full
float32 precision (IEEE, not TF32), and always accumulates in float32.
Dimensions need not be multiples of the tiles: loads and stores are
masked (rows past a segment, columns past K or N), and a tile is cut to
the next power of two of a small dimension (at least 16, Triton's least
dot).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from linen_moe._src.kernels.gpu.triton_tiles import Tiles
from linen_moe._src.kernels.tpu import gmm_schedule

_F32 = jnp.float32
# The least block side Triton's `tl.dot` takes.
MIN_BLOCK = 16


def compute_dtype(*dtypes) -> jnp.dtype:
  """What the tensor cores are fed: bfloat16 (float16) when every operand
  is, else float32."""
  for half in (jnp.bfloat16, jnp.float16):
    if all(jnp.dtype(d) == half for d in dtypes):
      return jnp.dtype(half)
  return jnp.dtype(_F32)


def _precision(dtype):
  """float32 products in IEEE float32: Pallas-Triton's default for float32
  operands is TF32."""
  return lax.Precision.HIGHEST if dtype == _F32 else None


def block(size: int, dim: int) -> int:
  """`size` cut to the next power of two of `dim` (at least `MIN_BLOCK`)."""
  return min(size, max(MIN_BLOCK, pl.next_power_of_2(dim)))


def work_items(group_sizes: jax.Array, m: int, block_m: int):
  """The work items of `gmm` over M rows in row tiles of `block_m`.

  Args:
    group_sizes: <int32>[G] rows per group, in order (negative ones count
      as 0; rows past M are dropped).
    m: rows of lhs (M >= 1).
    block_m: rows per tile.

  Returns:
    (segment, tile, starts, ends, count): segment, tile <int32>[V] the
    segment (group g < G, or G: the tail) and row tile of each item, V =
    cdiv(M, block_m) + G; starts, ends <int32>[>= G + 1] the rows
    [starts[s], ends[s]) of segment s; count <int32>[1] the items to run
    (the first `count`).
  """
  starts, ends = gmm_schedule.group_bounds(group_sizes, m)
  tail = (m - ends[-1])[None]
  sizes = jnp.concatenate([ends - starts, tail]).astype(jnp.int32)
  s = gmm_schedule.build(sizes, m, block_m, fill_tail=False, visit_empty=False)
  return s.group, s.tile, s.starts, s.ends, s.num_visits[None]


def _program(pid, rows: int, cols: int, group_m: int):
  """(row index, column index) of program `pid` of a `rows` x `cols` grid,
  in windows of `group_m` rows."""
  width = group_m * cols
  first = (pid // width) * group_m
  height = jnp.minimum(rows - first, group_m)
  return first + (pid % width) % height, (pid % width) // height


def _index(start, size: int):
  return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _within(start, size: int, dim: int):
  """<bool>[size]: which of the `size` indices from `start` are < `dim`;
  None where `dim` is a whole number of blocks (no mask to compute)."""
  return None if dim % size == 0 else _index(start, size) < dim


def _mask(rows, cols, shape):
  """The `shape` mask of a per-row and a per-column mask (None: all
  true; both None: no mask)."""
  if rows is None and cols is None:
    return None
  if rows is None:
    return jnp.broadcast_to(cols[None, :], shape)
  if cols is None:
    return jnp.broadcast_to(rows[:, None], shape)
  return rows[:, None] & cols[None, :]


def _load(ref, mask):
  """`ref`'s block; zeros where `mask` is false (Triton takes `other` only
  with a mask)."""
  return plgpu.load(ref, mask=mask, other=None if mask is None else 0)


def _params(tiles: Tiles):
  return plgpu.CompilerParams(
      num_warps=tiles.num_warps, num_stages=tiles.num_stages
  )


@functools.partial(
    jax.jit,
    static_argnames=("tiles", "out_dtype", "transpose_rhs", "interpret"),
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: Tiles,
    out_dtype,
    transpose_rhs: bool = False,
    interpret: bool = False,
) -> jax.Array:
  """[M, C] x [G, C, O] (or [G, O, C] with `transpose_rhs`) -> [M, O].

  Rows past sum(group_sizes) are zeros. No argument checks: the caller
  (`triton_grouped`) makes them.

  Args:
    lhs: [M, C], rows sorted by group.
    rhs: [G, C, O], or [G, O, C] when `transpose_rhs`.
    group_sizes: <int32>[G].
    tiles: the blocks and launch parameters (`Tiles`).
    out_dtype: the output's dtype.
    transpose_rhs: contract rhs's last dimension.
    interpret: run in Pallas interpret mode (any backend).

  Returns:
    [M, O] in `out_dtype`.
  """
  m, c = lhs.shape
  num_groups = rhs.shape[0]
  o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bc, bo = (
      block(tiles.block_m, m),
      block(tiles.block_k, c),
      block(tiles.block_n, o),
  )
  tiles_c, tiles_o = pl.cdiv(c, bc), pl.cdiv(o, bo)
  segment, tile, starts, ends, count = work_items(group_sizes, m, bm)
  max_items = segment.shape[0]
  dtype = compute_dtype(lhs.dtype, rhs.dtype)

  def kernel(seg_ref, tile_ref, starts_ref, ends_ref, count_ref, x, w, out):
    item, j = _program(pl.program_id(0), max_items, tiles_o, tiles.group_m)

    @pl.when(item < count_ref[0])
    def _():
      s = seg_ref[item]
      row0 = tile_ref[item] * bm
      rows = _index(row0, bm)
      mine = (rows >= starts_ref[s]) & (rows < ends_ref[s])
      col0 = j * bo
      cols_ok = _within(col0, bo, o)
      g = jnp.minimum(s, num_groups - 1)

      def step(kk, acc):
        k0 = kk * bc
        k_ok = _within(k0, bc, c)
        a = _load(
            x.at[pl.ds(row0, bm), pl.ds(k0, bc)],
            _mask(mine, k_ok, (bm, bc)),
        )
        if transpose_rhs:  # [bo, bc]
          b = _load(
              w.at[g, pl.ds(col0, bo), pl.ds(k0, bc)],
              _mask(cols_ok, k_ok, (bo, bc)),
          )
          dims = (((1,), (1,)), ((), ()))
        else:  # [bc, bo]
          b = _load(
              w.at[g, pl.ds(k0, bc), pl.ds(col0, bo)],
              _mask(k_ok, cols_ok, (bc, bo)),
          )
          dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(
            a.astype(dtype),
            b.astype(dtype),
            dims,
            precision=_precision(dtype),
            preferred_element_type=_F32,
        )

      # The tail segment (s == G) stores zeros: no step runs. (Not
      # `jnp.where`: Pallas-Triton lowers that bound into an invalid scf.for.)
      steps = (s < num_groups).astype(jnp.int32) * tiles_c
      acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bo), _F32))
      plgpu.store(
          out.at[pl.ds(row0, bm), pl.ds(col0, bo)],
          acc.astype(out.dtype),
          mask=_mask(mine, cols_ok, (bm, bo)),
      )

  size = lambda a: a.size * jnp.dtype(a.dtype).itemsize  # noqa: E731
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
      grid=(max_items * tiles_o,),
      compiler_params=_params(tiles),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=2 * m * c * o,
          transcendentals=0,
          bytes_accessed=size(lhs) * tiles_o
          + size(rhs) * pl.cdiv(m, bm)
          + m * o * jnp.dtype(out_dtype).itemsize,
      ),
      name="linen_moe_triton_gmm_t"
      if transpose_rhs
      else "linen_moe_triton_gmm",
  )
  return call(segment, tile, starts, ends, count, lhs, rhs)


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "interpret"))
def tgmm(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: Tiles,
    out_dtype,
    interpret: bool = False,
) -> jax.Array:
  """lhs [M, K], dout [M, N] -> [G, K, N]: lhs[rows of g]^T @ dout[rows of g].

  Empty groups get zeros; rows past sum(group_sizes) take part in nothing.

  Args:
    lhs: [M, K], rows sorted by group.
    dout: [M, N].
    group_sizes: <int32>[G].
    tiles: block_m rows per loop step, block_k x block_n output blocks.
    out_dtype: the output's dtype.
    interpret: run in Pallas interpret mode (any backend).

  Returns:
    [G, K, N] in `out_dtype`.
  """
  m, k = lhs.shape
  n = dout.shape[1]
  num_groups = group_sizes.shape[0]
  bm, bk, bn = (
      block(tiles.block_m, m),
      block(tiles.block_k, k),
      block(tiles.block_n, n),
  )
  tiles_k, tiles_n = pl.cdiv(k, bk), pl.cdiv(n, bn)
  starts, ends = gmm_schedule.group_bounds(group_sizes, m)
  dtype = compute_dtype(lhs.dtype, dout.dtype)

  def kernel(starts_ref, ends_ref, x, dy, out):
    g, rest = jnp.divmod(pl.program_id(0), tiles_k * tiles_n)
    k0, n0 = (rest // tiles_n) * bk, (rest % tiles_n) * bn
    lo, hi = starts_ref[g], ends_ref[g]
    k_ok, n_ok = _within(k0, bk, k), _within(n0, bn, n)

    def step(r, acc):
      r0 = lo + r * bm
      mine = _index(r0, bm) < hi
      a = _load(
          x.at[pl.ds(r0, bm), pl.ds(k0, bk)],
          _mask(mine, k_ok, (bm, bk)),
      )
      b = _load(
          dy.at[pl.ds(r0, bm), pl.ds(n0, bn)],
          _mask(mine, n_ok, (bm, bn)),
      )
      return acc + lax.dot_general(
          a.astype(dtype),
          b.astype(dtype),
          (((0,), (0,)), ((), ())),
          precision=_precision(dtype),
          preferred_element_type=_F32,
      )

    steps = (hi - lo + bm - 1) // bm
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bk, bn), _F32))
    plgpu.store(
        out.at[g, pl.ds(k0, bk), pl.ds(n0, bn)],
        acc.astype(out.dtype),
        mask=_mask(k_ok, n_ok, (bk, bn)),
    )

  size = lambda a: a.size * jnp.dtype(a.dtype).itemsize  # noqa: E731
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      grid=(num_groups * tiles_k * tiles_n,),
      compiler_params=_params(tiles),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=2 * m * k * n,
          transcendentals=0,
          bytes_accessed=size(lhs) * tiles_n
          + size(dout) * tiles_k
          + num_groups * k * n * jnp.dtype(out_dtype).itemsize,
      ),
      name="linen_moe_triton_tgmm",
  )
  return call(starts, ends, lhs, dout)
