"""Pallas TPU kernels of the grouped matmul, forward and weight gradient.

  gmm   lhs [M, C] x rhs [G, C, O] -> [M, O]: each row times its group's
        matrix (`transpose_rhs`: rhs [G, O, C], each row times the transpose,
        the input gradient's contraction).
  tgmm  lhs [M, K], dout [M, N] -> [G, K, N]: per group, the sum over its
        rows of lhs[r]^T dout[r] (the weight gradient).

Both work on the visits of `gmm_schedule`: a row tile straddling two groups
is visited once per group and each visit keeps only its group's rows (a
select on the rows, only on the tiles that straddle), so a group costs the
tiles it touches, not whole tiles of padding (and of a straddled tile of
more than 128 rows, only the 128-row sub-blocks holding its rows:
`sub_block`); tiles past sum(group_sizes)
are visited by no group (`gmm` writes their zeros without a matmul), and
visits beyond the schedule's count are not run at all (a dynamic grid). A
visit without a matmul reads the blocks its predecessor read, so it issues
no copy.

Operands are float32 or bfloat16; the product runs in bfloat16 when both
are bfloat16, else in float32 (at full float32 precision), and always
accumulates in float32 (an
accumulator in VMEM across the contraction's tiles, or across a group's
visits for `tgmm`). Tiles are given by the caller (`gmm_tiling` chooses
them): (tm, tc, to) rows, contraction and output columns for `gmm`; (tm,
tk, tn) for `tgmm`. tc / to and tk / tn divide their dimension; tm need
not divide M (the last row tile is partial: Pallas drops the rows past M
it writes, and the rows past M it reads are masked where they could meet
a product).

Grid order. `gmm`: (output column tiles, visits, contraction tiles), the
contraction innermost so that an output tile is finished before the next
visit; the visits of one row tile are consecutive, so its output block
stays in VMEM between them (Pallas writes a block back when its index
changes). `tgmm`: (N tiles, K tiles, visits), the visits of one group
consecutive, accumulating its [tk, tn] block.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from linen_moe._src.kernels.tpu import gmm_schedule

_F32 = jnp.float32
_PRODUCT_DIMS = (((1,), (0,)), ((), ()))  # [tm, tc] x [tc, to]
_PRODUCT_DIMS_T = (((1,), (1,)), ((), ()))  # [tm, tc] x [to, tc]


def compute_dtype(*dtypes) -> jnp.dtype:
  """bfloat16 when every operand is, else float32: what the MXU is fed."""
  if all(jnp.dtype(d) == jnp.bfloat16 for d in dtypes):
    return jnp.dtype(jnp.bfloat16)
  return jnp.dtype(_F32)


def _precision(dtype):
  """A float32 product in full float32 (Mosaic's `contract_precision<fp32>`),
  not in bf16 passes: float32 operands ask for float32 rounding."""
  return lax.Precision.HIGHEST if dtype == _F32 else None


def gmm_vmem_bytes(
    tiling, lhs_dtype, rhs_dtype, out_dtype, tiles_c, pairs=(1, 1)
) -> int:
  """VMEM of `gmm` with `tiling` (tm, tc, to): lhs, rhs and output blocks
  double-buffered, the float32 product, and the accumulator when the
  contraction has more than one tile or the rows split (`sub_block`);
  `pairs` = (lhs, rhs) operands of a call with several (one output per
  rhs for one lhs, else one)."""
  tm, tc, to = tiling
  num_lhs, num_rhs = pairs
  outputs = num_rhs if num_lhs == 1 else 1
  size = lambda d: jnp.dtype(d).itemsize  # noqa: E731
  blocks = num_lhs * tm * tc * size(lhs_dtype) + num_rhs * tc * to * size(
      rhs_dtype
  )
  blocks += outputs * tm * to * size(out_dtype)
  accumulator = tiles_c > 1 or sub_block(tm) is not None
  return 2 * blocks + outputs * tm * to * 4 * (2 if accumulator else 1)


def tgmm_vmem_bytes(
    tiling, lhs_dtype, dout_dtype, out_dtype, outputs: int = 1
) -> int:
  """VMEM of `tgmm` with `tiling` (tm, tk, tn): lhs, dout and output blocks
  double-buffered, the transposed lhs tile, the float32 product and
  accumulator; with several cotangents (`outputs`), theirs each."""
  tm, tk, tn = tiling
  size = lambda d: jnp.dtype(d).itemsize  # noqa: E731
  blocks = tm * tk * size(lhs_dtype)
  blocks += outputs * (tm * tn * size(dout_dtype) + tk * tn * size(out_dtype))
  return 2 * blocks + tm * tk * size(lhs_dtype) + outputs * 2 * tk * tn * 4


def _compiler_params(semantics, vmem_limit_bytes):
  return pltpu.CompilerParams(
      dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes
  )


# Rows of the sub-blocks a row tile is multiplied in where a visit's group
# holds only part of it: the MXU's height, so that no product is smaller.
SUB_BLOCK_ROWS = 128


def sub_block(tm: int) -> int | None:
  """The rows of a `tm`-row tile's sub-blocks (`SUB_BLOCK_ROWS`), or None
  when the tile is one sub-block or not a whole number of them."""
  if tm > SUB_BLOCK_ROWS and tm % SUB_BLOCK_ROWS == 0:
    return SUB_BLOCK_ROWS
  return None


def _each_sub_block(row0, tm, split, lo, hi, body):
  """Calls `body(rows)` (a static slice of the tile) for each `split`-row
  sub-block of the `tm`-row tile starting at row `row0` that holds rows of
  [lo, hi); the others are not multiplied at all."""
  for b in range(tm // split):
    start = row0 + b * split
    rows = slice(b * split, (b + 1) * split)
    pl.when((start < hi) & (start + split > lo))(functools.partial(body, rows))


def _rows_in(first_row, shape, lo, hi):
  """<bool>[shape]: which rows of a block whose first row is `first_row`
  lie in [lo, hi)."""
  rows = first_row + lax.broadcasted_iota(jnp.int32, shape, 0)
  return (rows >= lo) & (rows < hi)


@functools.partial(
    jax.jit,
    static_argnames=(
        "tiling",
        "out_dtype",
        "transpose_rhs",
        "interpret",
        "vmem_limit_bytes",
    ),
)
def gmm(
    lhs: jax.Array | tuple[jax.Array, ...],
    rhs: jax.Array | tuple[jax.Array, ...],
    group_sizes: jax.Array,
    *,
    tiling: tuple[int, int, int],
    out_dtype,
    transpose_rhs: bool = False,
    interpret: bool = False,
    vmem_limit_bytes: int | None = None,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
  """[M, C] x [G, C, O] (or [G, O, C] with `transpose_rhs`) -> [M, O].

  Rows past sum(group_sizes) are zeros. No argument checks: the caller
  (`pallas_grouped`) makes them. With `scales`, int8 operands: the product
  accumulates in int32 and the epilogue scales it, out = float32(acc) *
  lhs_scale[row] * rhs_scale[group, column] (in that order), so no float
  copy of either operand is made.

  Several weights in one call (`pallas_gate_up`): with `rhs` a tuple of P
  weights and one `lhs`, P outputs `lhs @ rhs[p]`, each lhs tile read once
  for all; with `lhs` a tuple of P too, one output, the sum over p of
  `lhs[p] @ rhs[p]`, accumulated in float32 in the kernel.

  Args:
    lhs: [M, C], rows sorted by group; or a tuple of them (see above).
    rhs: [G, C, O], or [G, O, C] when `transpose_rhs`; or a tuple of them.
    group_sizes: <int32>[G].
    tiling: (tm, tc, to): rows, contraction and output columns per tile.
    out_dtype: the output's dtype.
    transpose_rhs: contract rhs's last dimension.
    interpret: run in Pallas interpret mode (any backend).
    vmem_limit_bytes: Mosaic's scoped VMEM limit, or None for its default.
    scales: (lhs_scale <float32>[M, 1], rhs_scale <float32>[G, 1, O]) for
      int8 lhs and rhs; None for float operands.

  Returns:
    [M, O] in `out_dtype`; a tuple of P of them for P weights and one lhs.
  """
  lhs_all = lhs if isinstance(lhs, tuple) else (lhs,)
  rhs_all = rhs if isinstance(rhs, tuple) else (rhs,)
  summed = len(lhs_all) > 1
  if summed and len(lhs_all) != len(rhs_all):
    raise ValueError(
        f"gmm sums lhs[p] @ rhs[p]: {len(lhs_all)} lhs for {len(rhs_all)} rhs."
    )
  outputs = 1 if summed else len(rhs_all)
  m, c = lhs_all[0].shape
  o = rhs_all[0].shape[1] if transpose_rhs else rhs_all[0].shape[2]
  tm, tc, to = tiling
  tiles_c, tiles_o = c // tc, o // to
  last_c = tiles_c - 1
  schedule = gmm_schedule.build(
      group_sizes, m, tm, fill_tail=True, visit_empty=False
  )
  if scales is None:
    dtype = compute_dtype(*(a.dtype for a in (*lhs_all, *rhs_all)))
    acc_dtype, precision = _F32, _precision(dtype)
  else:
    dtype, acc_dtype, precision = jnp.dtype(jnp.int8), jnp.int32, None
  dims = _PRODUCT_DIMS_T if transpose_rhs else _PRODUCT_DIMS
  split = sub_block(tm)
  num_lhs, num_rhs = len(lhs_all), len(rhs_all)

  def kernel(group, tile, compute, _rg, _rt, starts, ends, *refs):
    xs, ws, refs = (
        refs[:num_lhs],
        refs[num_lhs : num_lhs + num_rhs],
        refs[num_lhs + num_rhs :],
    )
    epilogue = lambda v: v  # noqa: E731
    if scales is not None:
      lhs_scale, rhs_scale, *refs = refs

      def epilogue(v):  # <int32>[tm, to] -> <f32>, scaled
        return v.astype(_F32) * lhs_scale[...] * rhs_scale[...]

    outs, accs = refs[:outputs], refs[outputs:]
    i, kc = pl.program_id(1), pl.program_id(2)
    first = (i == 0) | (tile[i] != tile[jnp.maximum(i - 1, 0)])
    does = compute[i] == 1

    def store(q, value):  # output q's <f32>[tm, to], this visit's rows kept
      g = group[i]
      keep = _rows_in(tile[i] * tm, (tm, to), starts[g], ends[g])
      before = jnp.where(first, 0.0, outs[q][...].astype(_F32))
      outs[q][...] = jnp.where(keep, value, before).astype(outs[q].dtype)

    def dot(x, w, rows):
      return lax.dot_general(
          x[rows, :].astype(dtype),
          w[...].astype(dtype),
          dims,
          precision=precision,
          preferred_element_type=acc_dtype,
      )

    def product(q, rows):  # output q's [rows, to] product of this visit
      if not summed:
        return dot(xs[0], ws[q], rows)
      total = dot(xs[0], ws[0], rows)
      for x, w in zip(xs[1:], ws[1:], strict=True):
        total += dot(x, w, rows)
      return total

    def accumulate(q, rows, p):  # into accs[q][rows] over the contraction
      @pl.when(kc == 0)
      def _():
        accs[q][rows, :] = p

      @pl.when(kc > 0)
      def _():
        accs[q][rows, :] += p

    g = group[i]
    row0 = tile[i] * tm
    inside = (row0 >= starts[g]) & (row0 + tm <= ends[g])

    @pl.when(does & inside if split else does)
    def _():
      for q in range(outputs):
        p = product(q, slice(None))
        if tiles_c == 1:
          store(q, epilogue(p))
          continue

        @pl.when(kc < last_c)
        def _(q=q, p=p):
          accumulate(q, slice(None), p)

        @pl.when(kc == last_c)
        def _(q=q, p=p):
          store(q, epilogue(accs[q][...] + p))

    if split:
      # A tile the visit's group only partly holds: only the sub-blocks
      # holding its rows are multiplied (the rest stay stale in the
      # accumulator, and `store` keeps none of their rows).
      @pl.when(does & jnp.logical_not(inside))
      def _():
        for q in range(outputs):
          _each_sub_block(
              row0,
              tm,
              split,
              starts[g],
              ends[g],
              lambda rows, q=q: accumulate(q, rows, product(q, rows)),
          )

        @pl.when(kc == last_c)
        def _():
          for q in range(outputs):
            store(q, epilogue(accs[q][...]))

    @pl.when(jnp.logical_not(does) & (kc == last_c))
    def _():
      for q in range(outputs):
        store(q, jnp.zeros((tm, to), _F32))

  # A visit without a matmul reads its predecessor's last blocks: no copy.
  def k_of(i, kc, compute):
    return jnp.where(compute[i] == 1, kc, last_c)

  def lhs_map(j, i, kc, group, tile, compute, rgroup, rtile, *_):
    return rtile[i], k_of(i, kc, compute)

  def rhs_map(j, i, kc, group, tile, compute, rgroup, rtile, *_):
    if transpose_rhs:
      return rgroup[i], j, k_of(i, kc, compute)
    return rgroup[i], k_of(i, kc, compute), j

  def out_map(j, i, kc, group, tile, *_):
    return tile[i], j

  def lhs_scale_map(j, i, kc, group, tile, compute, rgroup, rtile, *_):
    return rtile[i], 0

  def rhs_scale_map(j, i, kc, group, tile, compute, rgroup, rtile, *_):
    return rgroup[i], 0, j

  rhs_block = (None, to, tc) if transpose_rhs else (None, tc, to)
  num_groups = rhs_all[0].shape[0]
  visits = gmm_schedule.max_visits(m, tm, num_groups)
  itemsize = lambda a: jnp.dtype(a.dtype).itemsize  # noqa: E731
  cost = pl.CostEstimate(
      flops=2 * m * c * o * max(num_lhs, num_rhs),
      transcendentals=0,
      bytes_accessed=sum(m * c * itemsize(x) for x in lhs_all) * tiles_o
      + sum(visits * c * o * itemsize(w) for w in rhs_all)
      + outputs * m * o * jnp.dtype(out_dtype).itemsize,
  )
  scale_specs = []
  if scales is not None:
    scale_specs = [
        pl.BlockSpec((tm, 1), lhs_scale_map),
        pl.BlockSpec((None, 1, to), rhs_scale_map),
    ]
  uses_acc = tiles_c > 1 or split is not None
  out_spec = pl.BlockSpec((tm, to), out_map)
  call = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((m, o), out_dtype)] * outputs,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=7,
          grid=(tiles_o, schedule.num_visits, tiles_c),
          in_specs=[
              *[pl.BlockSpec((tm, tc), lhs_map)] * num_lhs,
              *[pl.BlockSpec(rhs_block, rhs_map)] * num_rhs,
              *scale_specs,
          ],
          out_specs=[out_spec] * outputs,
          scratch_shapes=[pltpu.VMEM((tm, to), acc_dtype)] * outputs
          if uses_acc
          else [],
      ),
      compiler_params=_compiler_params(
          ("parallel", "arbitrary", "arbitrary"), vmem_limit_bytes
      ),
      interpret=interpret,
      cost_estimate=cost,
      name="linen_moe_gmm_t" if transpose_rhs else "linen_moe_gmm",
  )
  result = call(*schedule.prefetch(), *lhs_all, *rhs_all, *(scales or ()))
  return tuple(result) if isinstance(rhs, tuple) and not summed else result[0]


@functools.partial(
    jax.jit,
    static_argnames=("tiling", "out_dtype", "interpret", "vmem_limit_bytes"),
)
def tgmm(
    lhs: jax.Array,
    dout: jax.Array | tuple[jax.Array, ...],
    group_sizes: jax.Array,
    *,
    tiling: tuple[int, int, int],
    out_dtype,
    interpret: bool = False,
    vmem_limit_bytes: int | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
  """lhs [M, K], dout [M, N] -> [G, K, N]: lhs[rows of g]^T @ dout[rows of g].

  Empty groups get zeros; rows past sum(group_sizes) take part in nothing.
  With `dout` a tuple (`pallas_gate_up`), one output per cotangent, each
  lhs tile read once for all.

  Args:
    lhs: [M, K], rows sorted by group.
    dout: [M, N], or a tuple of them.
    group_sizes: <int32>[G].
    tiling: (tm, tk, tn): rows, K and N columns per tile.
    out_dtype: the output's dtype.
    interpret: run in Pallas interpret mode (any backend).
    vmem_limit_bytes: Mosaic's scoped VMEM limit, or None for its default.

  Returns:
    [G, K, N] in `out_dtype`; a tuple of them for a tuple `dout`.
  """
  douts = dout if isinstance(dout, tuple) else (dout,)
  outputs = len(douts)
  m, k = lhs.shape
  n = douts[0].shape[1]
  num_groups = group_sizes.shape[0]
  tm, tk, tn = tiling
  schedule = gmm_schedule.build(
      group_sizes, m, tm, fill_tail=False, visit_empty=True
  )
  last_visit = gmm_schedule.max_visits(m, tm, num_groups) - 1
  dtype = compute_dtype(lhs.dtype, *(d.dtype for d in douts))
  split = sub_block(tm)

  def kernel(group, tile, compute, _rg, _rt, starts, ends, x, *refs):
    dys, outs, accs = (
        refs[:outputs],
        refs[outputs : 2 * outputs],
        refs[2 * outputs :],
    )
    i = pl.program_id(2)
    g = group[i]
    first = (i == 0) | (group[jnp.maximum(i - 1, 0)] != g)
    last = (i == pl.num_programs(2) - 1) | (
        group[jnp.minimum(i + 1, last_visit)] != g
    )
    lo, hi = starts[g], ends[g]
    row0 = tile[i] * tm
    inside = (row0 >= lo) & (row0 + tm <= hi)
    does = compute[i] == 1

    @pl.when(first)
    def _():
      for acc in accs:
        acc[...] = jnp.zeros_like(acc)

    def accumulate(a, bs):  # a [rows, tk] into each acc with its b
      a_t = a.astype(dtype).T
      for acc, b in zip(accs, bs, strict=True):
        acc[...] += lax.dot_general(
            a_t,
            b.astype(dtype),
            _PRODUCT_DIMS,
            precision=_precision(dtype),
            preferred_element_type=_F32,
        )

    @pl.when(does & inside)
    def _():
      accumulate(x[...], [dy[...] for dy in dys])

    def masked(rows):  # the block's rows of the group, else 0 (all)
      first_row = row0 + (rows.start or 0)

      def keep(v):
        return jnp.where(_rows_in(first_row, v.shape, lo, hi), v, 0)

      return keep(x[rows, :]), [keep(dy[rows, :]) for dy in dys]

    # Both operands masked: a foreign row's inf (or a partial tile's
    # garbage past M) times a zero would still be NaN. Split tiles multiply
    # only the sub-blocks that hold the group's rows.
    @pl.when(does & jnp.logical_not(inside))
    def _():
      if split is None:
        accumulate(*masked(slice(None)))
        return
      _each_sub_block(
          row0, tm, split, lo, hi, lambda rows: accumulate(*masked(rows))
      )

    @pl.when(last)
    def _():
      for out, acc in zip(outs, accs, strict=True):
        out[...] = acc[...].astype(out.dtype)

  def lhs_map(j, kk, i, group, tile, compute, rgroup, rtile, *_):
    return rtile[i], kk

  def dout_map(j, kk, i, group, tile, compute, rgroup, rtile, *_):
    return rtile[i], j

  def out_map(j, kk, i, group, *_):
    return group[i], kk, j

  cost = pl.CostEstimate(
      flops=2 * m * k * n * outputs,
      transcendentals=0,
      bytes_accessed=m * k * jnp.dtype(lhs.dtype).itemsize * (n // tn)
      + sum(m * n * jnp.dtype(d.dtype).itemsize for d in douts) * (k // tk)
      + outputs * num_groups * k * n * jnp.dtype(out_dtype).itemsize,
  )
  call = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((num_groups, k, n), out_dtype)] * outputs,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=7,
          grid=(n // tn, k // tk, schedule.num_visits),
          in_specs=[
              pl.BlockSpec((tm, tk), lhs_map),
              *[pl.BlockSpec((tm, tn), dout_map)] * outputs,
          ],
          out_specs=[pl.BlockSpec((None, tk, tn), out_map)] * outputs,
          scratch_shapes=[pltpu.VMEM((tk, tn), _F32)] * outputs,
      ),
      compiler_params=_compiler_params(
          ("parallel", "arbitrary", "arbitrary"), vmem_limit_bytes
      ),
      interpret=interpret,
      cost_estimate=cost,
      name="linen_moe_tgmm",
  )
  result = call(*schedule.prefetch(), lhs, *douts)
  return tuple(result) if isinstance(dout, tuple) else result[0]
