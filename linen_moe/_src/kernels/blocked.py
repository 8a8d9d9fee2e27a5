"""The "blocked" grouped matmul: pure JAX, any backend, the contract of
`grouped_matmul` (lhs [M, K] rows sorted by group x rhs [G, K, N] -> [M, N],
rows past sum(group_sizes) zero). Each group's first C rows (C a little above
the mean group size) run in one batched matmul, the rows of overloaded groups
past C in row tiles; the weight is indexed from `rhs`, never gathered per
row, and a custom VJP keeps the backward grouped too. A small problem gives
every group M slots (`default_slot_rows`): one batched matmul, no loop.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
from jax import lax
import jax.numpy as jnp

from linen_moe._src.kernels.platform import target_platform

# Row-tile size of the overflow loop of "blocked". Measured on a 2-core CPU, M = 8192, G = 8, K, N
# in {512, 1024} and K, N = 64, 128: 256 rows per tile run each matmul at
# 85-100% of one dense matmul of the same FLOPs; 128 loses to per-tile
# overhead, 512 and 1024 to the rows wasted in each group's last tile.
_BLOCK_ROWS = 256
_MIN_BLOCK_ROWS = 8
# Each group's last tile computes a full tile of rows: on average half a tile
# per group is wasted. Tiles of a quarter of the mean group size keep that
# waste near 1/8 of the work; measured in CPU seconds (2-core CPU, 128 groups
# of ~256 rows, K x N = 512 x 128 and 128 x 512), tiles of 32-64 rows run
# forward+backward 15-20% faster than 256-row tiles, whose waste is ~50%.
_TILES_PER_MEAN_GROUP = 4
# Slots per group, over the mean group size. Measured on a 2-core CPU
# (forward+backward, 128 groups of ~256 rows, K x N = 512 x 128 and 128 x 512;
# 64 groups of ~16 rows, 256 x 512): one batched matmul over 1.25x padded
# slots runs 1.3-1.4x the time of a dense matmul of the useful FLOPs, against
# 1.7-2.1x for the best row-tile loop; with random routing few groups
# overflow 1.25x their mean.
_SLOT_HEADROOM = 1.25
# A problem this small gives every group M slots (C = M): no group can
# overflow, so no loop is built. Bounded so that the padding stays cheap: the
# slots hold at most 2^20 elements (4 MiB of float32) and their matmul at most
# 2^24 multiply-adds (~0.1 ms here), where the loops' per-iteration overhead
# and their compile time (18 while loops in a sparse layer's forward and
# backward) would dominate.
_ALL_SLOTS_MAX_ELEMENTS = 1 << 20
_ALL_SLOTS_MAX_WORK = 1 << 24

# [M, K] x [K, N] -> [M, N], and the same with rhs given as [N, K].
_DIMS_NN = (((1,), (0,)), ((), ()))
_DIMS_NT = (((1,), (1,)), ((), ()))
# [R, K] x [R, N] -> [K, N]: the contraction of the weight gradient.
_DIMS_TN = (((0,), (0,)), ((), ()))


# ----------------------------------------------------------------------------
# "blocked": each group's first C rows as one batched matmul, the rest in row
# tiles.
#
# Slots. Every group's first C rows ("slots", C a little above the mean group
# size) are gathered into [G, C, K] and multiplied by rhs in one batched
# matmul: no loop, each weight read once, a few padded rows per group. Rows
# go back by a gather (each row reads its slot), so nothing is scattered.
#
# Overflow. A group's rows past its first C (an overloaded expert) run in
# row tiles: the overflow of group g is cut into tiles of bm rows from its
# first overflow row, the last tile spilling into the next group's rows and
# masked; a tile that would run past row M is shifted back to end at M. The
# loops run over the groups that overflow and their tiles only, so balanced
# groups cost no loop iteration at all. C = 0 is the pure tile loop.
# ----------------------------------------------------------------------------


def block_rows(m: int, num_groups: int) -> int:
  """Row-tile size of the overflow loop for M rows in G groups.

  A quarter of the mean group size, rounded down to a power of two, within
  [`_MIN_BLOCK_ROWS`, `_BLOCK_ROWS`] and never above M.
  """
  mean_group = max(1, m // max(num_groups, 1))
  quarter = max(1, mean_group // _TILES_PER_MEAN_GROUP)
  fit = max(_MIN_BLOCK_ROWS, 1 << (quarter.bit_length() - 1))
  return max(1, min(_BLOCK_ROWS, fit, m))


def slot_rows(m: int, num_groups: int) -> int:
  """C, the rows per group of the batched part: the mean group size times
  `_SLOT_HEADROOM`, rounded up to a multiple of 8, at most M."""
  mean_group = m / max(num_groups, 1)
  c = -(-math.ceil(_SLOT_HEADROOM * mean_group) // 8) * 8
  return min(m, max(8, c))


def default_slot_rows(m: int, num_groups: int, k: int, n: int) -> int:
  """C for [M, K] x [G, K, N]: M for a small problem (slots [G, M, max(K,
  N)] of at most `_ALL_SLOTS_MAX_ELEMENTS`, at most `_ALL_SLOTS_MAX_WORK`
  multiply-adds; then no row overflows and no loop is built), else
  `slot_rows(M, G)`."""
  slots = num_groups * m
  if (
      slots * max(k, n) <= _ALL_SLOTS_MAX_ELEMENTS
      and slots * k * n <= _ALL_SLOTS_MAX_WORK
  ):
    return m
  return slot_rows(m, num_groups)


@flax.struct.dataclass
class _Plan:
  """Where each group's rows, slots and overflow tiles are.

  Attributes:
    slot_row: <int32>[G, C] the row in each slot; M (read as zeros) if empty.
    row_slot: <int32>[M] the flat slot g * C + c of each row; G * C (read as
      zeros) for overflow rows and rows past sum(group_sizes).
    starts, ends: <int32>[G] each group's overflow rows [start, end).
    tiles_start, tiles_end: <int32>[G] each group's global overflow tiles.
    overflowing: <int32>[G] the groups with overflow tiles first, in order.
    num_overflowing: <int32>[] how many.
    may_overflow: (static) whether a group can have rows past its C slots;
      False when C >= M or C >= the caller's bound on every group's size.
  """

  slot_row: jax.Array
  row_slot: jax.Array
  starts: jax.Array
  ends: jax.Array
  tiles_start: jax.Array
  tiles_end: jax.Array
  overflowing: jax.Array
  num_overflowing: jax.Array
  may_overflow: bool = flax.struct.field(pytree_node=False, default=True)


def _plan(
    group_sizes: jax.Array,
    m: int,
    c: int,
    bm: int,
    max_group_size: int | None = None,
) -> _Plan:
  """The `_Plan` of M rows in groups of `group_sizes`, C slots, bm-row tiles
  (no group larger than `max_group_size`, when given)."""
  num_groups = group_sizes.shape[0]
  ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
  firsts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  slot_row = firsts[:, None] + lax.iota(jnp.int32, c)[None, :]  # [G, C]
  slot_row = jnp.where(slot_row < ends[:, None], slot_row, m)
  rows = lax.iota(jnp.int32, m)
  group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
  index = rows - firsts[jnp.minimum(group, num_groups - 1)]
  row_slot = jnp.where(
      (group < num_groups) & (index < c), group * c + index, num_groups * c
  )
  starts = jnp.minimum(firsts + c, ends)
  num_tiles = (ends - starts + bm - 1) // bm
  tiles_end = jnp.cumsum(num_tiles)
  (overflowing,) = jnp.nonzero(num_tiles > 0, size=num_groups, fill_value=0)
  return _Plan(
      slot_row=slot_row,
      row_slot=row_slot,
      starts=starts,
      ends=ends,
      tiles_start=tiles_end - num_tiles,
      tiles_end=tiles_end,
      overflowing=overflowing.astype(jnp.int32),
      num_overflowing=jnp.sum(num_tiles > 0, dtype=jnp.int32),
      may_overflow=c < min(m, max_group_size or m),
  )


def _zeros_varying_like(shape, dtype, *operands) -> jax.Array:
  """Zeros that vary (inside `shard_map`) over every mesh axis an operand
  varies over, so that a loop carry started from them has the manual-axes
  type of the loop body's output."""
  out = jnp.zeros(shape, dtype)
  for x in operands:
    out = out + jnp.zeros_like(x, shape=shape, dtype=dtype)
  return out


def _to_slots(x: jax.Array, plan: _Plan) -> jax.Array:
  """[M, D] rows -> [G, C, D] slots (zeros where a slot is empty)."""
  # A flat index gathers whole rows (measured ~1.5x faster on CPU than the
  # [G, C] index).
  flat = jnp.take(
      x, plan.slot_row.reshape(-1), axis=0, mode="fill", fill_value=0
  )
  return flat.reshape(*plan.slot_row.shape, x.shape[-1])


def _from_slots(y: jax.Array, plan: _Plan) -> jax.Array:
  """[G, C, D] slots -> [M, D] rows (zeros for rows without a slot)."""
  flat = y.reshape(-1, y.shape[-1])
  return jnp.take(flat, plan.row_slot, axis=0, mode="fill", fill_value=0)


def _tile(plan: _Plan, g: jax.Array, t: jax.Array, m: int, bm: int):
  """Overflow tile `t` (a global tile index) of group `g`: (first row, row
  mask [bm])."""
  first = plan.starts[g] + (t - plan.tiles_start[g]) * bm
  offset = jnp.minimum(first, m - bm)
  rows = offset + lax.iota(jnp.int32, bm)
  return offset, (rows >= first) & (rows < plan.ends[g])


def _over_overflow(plan: _Plan, group_body, init):
  """fori_loop of `group_body(g, carry)` over the overflowing groups; `init`
  itself, and no loop built, when every row has a slot (`may_overflow`)."""
  if not plan.may_overflow:
    return init
  return lax.fori_loop(
      0,
      plan.num_overflowing,
      lambda i, carry: group_body(plan.overflowing[i], carry),
      init,
  )


def _over_tiles(plan: _Plan, g: jax.Array, tile_body, init):
  """fori_loop of `tile_body(t, carry)` over the global tile indices of `g`."""
  return lax.fori_loop(plan.tiles_start[g], plan.tiles_end[g], tile_body, init)


def _dot(x: jax.Array, w: jax.Array, dims, out_dtype) -> jax.Array:
  """`lax.dot_general` with a float32 accumulator for narrow floats
  (`_grad_dtype`); the result in `out_dtype`.

  Narrow operands go into the dot as they are, on CPU too (not upcast as
  `float32_accumulation` does there): an upcast weight is a float32 copy
  of all of rhs that depends on the parameters alone, which XLA:CPU
  computes early, so the copies of several layers' experts were live at
  once (0.8 GB each at Qwen3-30B-A3B's shape); its dot fusion converts
  the bfloat16 operands itself, no slower (measured: fwd+bwd of a
  [16384, 512] x [32, 512, 384] problem, 0.39 s against 0.41 s).
  """
  acc = _grad_dtype(out_dtype)
  return lax.dot_general(x, w, dims, preferred_element_type=acc).astype(
      out_dtype
  )


def _blocked_rows(
    lhs: jax.Array,
    rhs: jax.Array,
    plan: _Plan,
    bm: int,
    transpose_rhs: bool,
    out_dtype,
    lhs_slots: jax.Array | None = None,
    result_dtype=None,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N], or x [G, N, K] -> [M, N] if transposed.

  Each dot yields `out_dtype` (`_dot`), rounded at once to `result_dtype`
  (default `out_dtype`): every output row comes from one dot, so rounding
  there equals rounding the whole [M, N], without an [M, N] buffer of
  `out_dtype`.

  The slots (`lhs_slots`, `_to_slots(lhs)` if not given) in one batched
  matmul; then one [bm, K] x [K, N] matmul per overflow tile, rhs[g] sliced
  once per overflowing group (XLA copies a dynamic slice it feeds to a dot),
  not per tile.
  """
  m = lhs.shape[0]
  result_dtype = result_dtype or out_dtype
  contract = 1 if transpose_rhs else 0
  batched = (((2,), (1 + contract,)), ((0,), (0,)))
  if plan.slot_row.shape[1]:
    if lhs_slots is None:
      lhs_slots = _to_slots(lhs, plan)
    y = _dot(lhs_slots, rhs, batched, out_dtype).astype(result_dtype)
    out = _from_slots(y, plan)
  else:
    n = rhs.shape[2 - contract]
    out = _zeros_varying_like((m, n), result_dtype, lhs, rhs, plan.starts)

  def group_body(g, out):  # out: [M, N]
    w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)  # [K, N] or [N, K]

    def tile_body(t, out):
      offset, mask = _tile(plan, g, t, m, bm)
      x = lax.dynamic_slice_in_dim(lhs, offset, bm)  # [bm, K]
      y = _dot(x, w, _DIMS_NT if transpose_rhs else _DIMS_NN, out_dtype)
      y = y.astype(result_dtype)
      kept = lax.dynamic_slice_in_dim(out, offset, bm)
      y = jnp.where(mask[:, None], y, kept)
      return lax.dynamic_update_slice_in_dim(out, y, offset, 0)

    return _over_tiles(plan, g, tile_body, out)

  return _over_overflow(plan, group_body, out)


def _blocked_weight_grad(
    lhs: jax.Array,
    dout: jax.Array,
    plan: _Plan,
    bm: int,
    acc_dtype,
    lhs_slots: jax.Array,
    dout_slots: jax.Array,
) -> jax.Array:
  """drhs[g] = lhs[rows of g]^T @ dout[rows of g]: [M, K], [M, N] -> [G, K, N].

  The slots' products (`lhs_slots`, `dout_slots`: `_to_slots` of lhs and
  dout) in one batched matmul (empty slots are zero rows); an overflowing
  group adds the [bm, K]^T x [bm, N] products of its tiles.
  """
  m, k = lhs.shape
  n = dout.shape[1]
  batched = (((1,), (1,)), ((0,), (0,)))
  if plan.slot_row.shape[1]:
    drhs = lax.dot_general(
        lhs_slots,
        dout_slots,
        batched,
        preferred_element_type=acc_dtype,
    ).astype(acc_dtype)
  else:
    num_groups = plan.starts.shape[0]
    drhs = _zeros_varying_like(
        (num_groups, k, n), acc_dtype, lhs, dout, plan.starts
    )
  mask_lhs = k <= n  # zero the smaller operand's foreign rows

  def group_body(g, drhs):  # drhs: [G, K, N]
    def tile_body(t, acc):  # acc: [K, N]
      offset, mask = _tile(plan, g, t, m, bm)
      x = lax.dynamic_slice_in_dim(lhs, offset, bm)  # [bm, K]
      dy = lax.dynamic_slice_in_dim(dout, offset, bm)  # [bm, N]
      if mask_lhs:
        x = jnp.where(mask[:, None], x, 0)
      else:
        dy = jnp.where(mask[:, None], dy, 0)
      return acc + lax.dot_general(
          x, dy, _DIMS_TN, preferred_element_type=acc_dtype
      )

    acc = lax.dynamic_index_in_dim(drhs, g, keepdims=False)
    acc = _over_tiles(plan, g, tile_body, acc)
    return lax.dynamic_update_index_in_dim(drhs, acc, g, 0)

  return _over_overflow(plan, group_body, drhs)


def float32_accumulation(lhs: jax.Array, rhs: jax.Array):
  """(lhs, rhs, preferred_element_type) that accumulate a dot of narrow
  floats (bf16, fp8) in float32; other dtypes are returned unchanged.

  On CPU the operands are upcast instead: XLA:CPU's bf16 dot is ~2.5x slower
  than its float32 one, and some bf16 x bf16 -> f32 dots fail to run there
  ("Unsupported element type for DotThunk"). Elsewhere the dot takes the
  narrow operands with a float32 result, as the hardware wants.
  """
  dtype = jnp.result_type(lhs, rhs)
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize >= 4:
    return lhs, rhs, None
  if target_platform() == "cpu":
    return lhs.astype(jnp.float32), rhs.astype(jnp.float32), None
  return lhs, rhs, jnp.float32


def _grad_dtype(dtype) -> Any:
  """Accumulation dtype of the backward: float32 for narrower floats."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _blocked_vjp(lhs, rhs, group_sizes, c, bm, out_dtype, bound):
  plan = _plan(group_sizes, lhs.shape[0], c, bm, bound)
  return _blocked_rows(lhs, rhs, plan, bm, False, out_dtype)


def _blocked_vjp_fwd(lhs, rhs, group_sizes, c, bm, out_dtype, bound):
  plan = _plan(group_sizes, lhs.shape[0], c, bm, bound)
  out = _blocked_rows(lhs, rhs, plan, bm, False, out_dtype)
  return out, (lhs, rhs, plan)


def _blocked_vjp_bwd(c, bm, out_dtype, bound, residuals, dout):
  del c, out_dtype, bound
  # The barrier keeps XLA from merging the backward's slots (and, for
  # narrow floats on CPU, the float32 copy XLA:CPU makes of them for a
  # dot) with the forward's: merged, [G, C, K] would live from the forward to the
  # backward beside lhs itself (at Qwen3-30B-A3B's shape, S = 8192, 0.67 GB
  # a layer for wi_0 / wi_1 and 0.25 GB for wo, in float32). Gathered
  # again here, the slots live only in this backward.
  lhs, rhs, plan = residuals
  lhs, plan = jax.lax.optimization_barrier((lhs, plan))
  lhs_slots = _to_slots(lhs, plan)
  dout_slots = _to_slots(dout, plan)
  # dlhs = dout @ rhs[g]^T per row: [M, N] x [G, K, N] -> [M, K], each row
  # one dot accumulated in `_grad_dtype` and rounded once to lhs's dtype
  # (no float32 [M, K] buffer for a narrow lhs).
  dlhs = _blocked_rows(
      dout,
      rhs,
      plan,
      bm,
      True,
      _grad_dtype(lhs.dtype),
      dout_slots,
      result_dtype=lhs.dtype,
  )
  drhs = _blocked_weight_grad(
      lhs, dout, plan, bm, _grad_dtype(rhs.dtype), lhs_slots, dout_slots
  )
  return dlhs, drhs.astype(rhs.dtype), None


_blocked_vjp.defvjp(_blocked_vjp_fwd, _blocked_vjp_bwd)


def blocked_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    block_rows_override: int | None = None,
    slot_rows_override: int | None = None,
    max_group_size: int | None = None,
) -> jax.Array:
  """The "blocked" implementation: [M, K] x [G, K, N] -> [M, N].

  Float operands get a grouped custom VJP (dlhs the same way as the
  forward, drhs per group; no [G, M, ...] intermediate anywhere). Integer
  operands (e.g. int8 with `preferred_element_type=jnp.int32`) are forward
  only: callers that train through them bring their own VJP.

  Args:
    lhs: [M, K], rows sorted by group.
    rhs: [G, K, N].
    group_sizes: <int>[G].
    preferred_element_type: as for `jax.lax.dot_general`; the output dtype.
    block_rows_override: the overflow row-tile size; default
      `block_rows(M, G)`.
    slot_rows_override: C, the rows per group of the batched part; default
      `default_slot_rows(M, G, K, N)`; 0 runs every row in tiles.
    max_group_size: a static bound on every group's size that the caller
      knows (a MoE layer of T tokens, each choosing an expert at most once,
      gives no expert more than T rows), or None. The default C is then at
      most the bound, and when C reaches it no overflow loop is built.
  """
  (m, k), (num_groups, _, n) = lhs.shape, rhs.shape
  out_dtype = jax.eval_shape(
      functools.partial(
          lax.dot_general,
          dimension_numbers=_DIMS_NN,
          preferred_element_type=preferred_element_type,
      ),
      jax.ShapeDtypeStruct((1, k), lhs.dtype),
      jax.ShapeDtypeStruct((k, n), rhs.dtype),
  ).dtype
  if 0 in (m, n, num_groups):
    return jnp.zeros((m, n), out_dtype)
  bm = block_rows_override
  if bm is None:
    bm = block_rows(m, num_groups)
  if not 1 <= bm <= m:
    raise ValueError(f"block rows must be in [1, M={m}]; got {bm}.")
  if max_group_size is not None and (
      isinstance(max_group_size, bool)
      or not isinstance(max_group_size, int)
      or max_group_size < 1
  ):
    raise ValueError(
        "max_group_size must be a positive int or None; got"
        f" {max_group_size!r}."
    )
  c = slot_rows_override
  if c is None:
    c = min(default_slot_rows(m, num_groups, k, n), max_group_size or m)
  if not 0 <= c <= m:
    raise ValueError(f"slot rows must be in [0, M={m}]; got {c}.")
  if jnp.issubdtype(out_dtype, jnp.inexact):
    return _blocked_vjp(lhs, rhs, group_sizes, c, bm, out_dtype, max_group_size)
  plan = _plan(group_sizes, m, c, bm, max_group_size)
  return _blocked_rows(lhs, rhs, plan, bm, False, out_dtype)
