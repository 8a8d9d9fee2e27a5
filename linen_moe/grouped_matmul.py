"""Grouped matmul: rows of `lhs`, sorted by group, times their group's matrix.

  out[i] = lhs[i] @ rhs[g(i)]   for rows i of group g(i), i < sum(group_sizes)
  out[i] = 0                    for the rows past sum(group_sizes)

Shapes: lhs [M, K], rhs [G, K, N], group_sizes <int32>[G] -> [M, N].
Group g holds rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])), cut at M:
a total above M drops the rows past M, as `jax.lax.ragged_dot` does. Group
sizes are traced values under `jit`, so neither check can happen at trace
time; negative sizes give unspecified results. Knows nothing of MoE or
quantization.

Implementations:
  "ragged_dot"  `jax.lax.ragged_dot`. On CPU it lowers to a masked dense matmul
                over every group: G times the useful work.
  "blocked"     Pure JAX, any backend: one dense [bm, K] x [K, N] matmul per
                row tile, the tile's weight indexed from `rhs`, never gathered;
                a custom VJP keeps the backward grouped too.
  "kernel"      An accelerator kernel when one is importable: Pallas megablox
                `gmm` on TPU, Tokamax `ragged_dot` on GPU.
  "auto"        "blocked" on CPU; on GPU/TPU the kernel when importable for the
                operand dtypes, else "ragged_dot".
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "ragged_dot", "blocked", "kernel")

# Row-tile size of "blocked". Measured on a 2-core CPU, M = 8192, G = 8, K, N
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

# [M, K] x [K, N] -> [M, N], and the same with rhs given as [N, K].
_DIMS_NN = (((1,), (0,)), ((), ()))
_DIMS_NT = (((1,), (1,)), ((), ()))
# [R, K] x [R, N] -> [K, N]: the contraction of the weight gradient.
_DIMS_TN = (((0,), (0,)), ((), ()))


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
) -> jax.Array:
  """XLA's `jax.lax.ragged_dot`: the reference implementation."""
  return jax.lax.ragged_dot(
      lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type=preferred_element_type,
  )


# ----------------------------------------------------------------------------
# "blocked": row tiles in the original row order, one dense matmul per tile.
#
# Group g is cut into ceil(size_g / bm) tiles of bm rows, starting at its first
# row; tile j of g covers rows [start_g + j * bm, start_g + (j + 1) * bm). The
# last tile of a group spills into the next group's rows, so each tile writes
# only the rows of its own group (a row mask). No padded copy of lhs or out is
# made; a tile that would run past row M is shifted back to end at M, and its
# mask drops the rows it repeats. There are at most ceil(M / bm) + G - 1 tiles;
# the loops (over groups, then over each group's tiles) run over the tiles that
# exist, not over that bound, so an empty group costs nothing.
# ----------------------------------------------------------------------------


def block_rows(m: int, num_groups: int) -> int:
  """Row-tile size of "blocked" for M rows in G groups.

  A quarter of the mean group size, rounded down to a power of two, within
  [`_MIN_BLOCK_ROWS`, `_BLOCK_ROWS`] and never above M.
  """
  mean_group = max(1, m // max(num_groups, 1))
  quarter = max(1, mean_group // _TILES_PER_MEAN_GROUP)
  fit = max(_MIN_BLOCK_ROWS, 1 << (quarter.bit_length() - 1))
  return max(1, min(_BLOCK_ROWS, fit, m))


def _tile_plan(group_sizes: jax.Array, m: int, bm: int) -> dict[str, Any]:
  """Where each group's rows and row tiles are; all <int32>[G]."""
  ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  num_tiles = (jnp.maximum(ends - starts, 0) + bm - 1) // bm
  tiles_end = jnp.cumsum(num_tiles)
  return {
      "starts": starts,
      "ends": ends,
      "tiles_start": tiles_end - num_tiles,
      "tiles_end": tiles_end,
  }


def _tile(plan: dict[str, Any], g: jax.Array, t: jax.Array, m: int, bm: int):
  """Tile `t` (a global tile index) of group `g`: (first row, row mask [bm])."""
  first = plan["starts"][g] + (t - plan["tiles_start"][g]) * bm
  offset = jnp.minimum(first, m - bm)
  rows = offset + lax.iota(jnp.int32, bm)
  return offset, (rows >= first) & (rows < plan["ends"][g])


def _zeros_varying_like(shape, dtype, *operands) -> jax.Array:
  """Zeros that vary (inside `shard_map`) over every mesh axis an operand
  varies over, so that a loop carry started from them has the manual-axes
  type of the loop body's output."""
  out = jnp.zeros(shape, dtype)
  for x in operands:
    out = out + jnp.zeros_like(x, shape=shape, dtype=dtype)
  return out


def _over_tiles(plan: dict[str, Any], g: jax.Array, tile_body, init):
  """fori_loop of `tile_body(t, carry)` over the global tile indices of `g`."""
  return lax.fori_loop(
      plan["tiles_start"][g], plan["tiles_end"][g], tile_body, init
  )


def _blocked_rows(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    bm: int,
    transpose_rhs: bool,
    out_dtype,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N], or x [G, N, K] -> [M, N] if transposed.

  One [bm, K] x [K, N] matmul per tile of each group; rhs[g] is sliced once
  per group (XLA copies a dynamic slice it feeds to a dot), not per tile.
  """
  m = lhs.shape[0]
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  dims = _DIMS_NT if transpose_rhs else _DIMS_NN
  plan = _tile_plan(group_sizes, m, bm)
  narrow = jnp.issubdtype(out_dtype, jnp.floating) and _grad_dtype(
      out_dtype
  ) != jnp.dtype(out_dtype)

  def group_body(g, out):  # out: [M, N]
    w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)  # [K, N] or [N, K]

    def tile_body(t, out):
      offset, mask = _tile(plan, g, t, m, bm)
      x = lax.dynamic_slice_in_dim(lhs, offset, bm)  # [bm, K]
      if narrow:  # float32 accumulation; the output keeps `out_dtype`
        a, b, acc = float32_accumulation(x, w)
        y = lax.dot_general(a, b, dims, preferred_element_type=acc)
      else:
        y = lax.dot_general(x, w, dims, preferred_element_type=out_dtype)
      y = y.astype(out_dtype)
      kept = lax.dynamic_slice_in_dim(out, offset, bm)
      y = jnp.where(mask[:, None], y, kept)
      return lax.dynamic_update_slice_in_dim(out, y, offset, 0)

    return _over_tiles(plan, g, tile_body, out)

  out = _zeros_varying_like((m, n), out_dtype, lhs, rhs, group_sizes)
  return lax.fori_loop(0, num_groups, group_body, out)


def _blocked_weight_grad(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    num_groups: int,
    bm: int,
    acc_dtype,
) -> jax.Array:
  """drhs[g] = lhs[rows of g]^T @ dout[rows of g]: [M, K], [M, N] -> [G, K, N].

  Per group, a [K, N] accumulator sums the [bm, K]^T x [bm, N] products of its
  tiles; an empty group gets zeros.
  """
  m, k = lhs.shape
  n = dout.shape[1]
  plan = _tile_plan(group_sizes, m, bm)
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

    zeros = _zeros_varying_like((k, n), acc_dtype, lhs, dout, group_sizes)
    acc = _over_tiles(plan, g, tile_body, zeros)
    return lax.dynamic_update_index_in_dim(drhs, acc, g, 0)

  drhs = _zeros_varying_like(
      (num_groups, k, n), acc_dtype, lhs, dout, group_sizes
  )
  return lax.fori_loop(0, num_groups, group_body, drhs)


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
  if jax.default_backend() == "cpu":
    return lhs.astype(jnp.float32), rhs.astype(jnp.float32), None
  return lhs, rhs, jnp.float32


def _grad_dtype(dtype) -> Any:
  """Accumulation dtype of the backward: float32 for narrower floats."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked_vjp(lhs, rhs, group_sizes, bm, out_dtype):
  return _blocked_rows(lhs, rhs, group_sizes, bm, False, out_dtype)


def _blocked_vjp_fwd(lhs, rhs, group_sizes, bm, out_dtype):
  out = _blocked_rows(lhs, rhs, group_sizes, bm, False, out_dtype)
  return out, (lhs, rhs, group_sizes)


def _blocked_vjp_bwd(bm, out_dtype, residuals, dout):
  del out_dtype
  lhs, rhs, group_sizes = residuals
  # dlhs = dout @ rhs[g]^T per tile: [M, N] x [G, K, N] -> [M, K].
  dlhs = _blocked_rows(dout, rhs, group_sizes, bm, True, _grad_dtype(lhs.dtype))
  drhs = _blocked_weight_grad(
      lhs, dout, group_sizes, rhs.shape[0], bm, _grad_dtype(rhs.dtype)
  )
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


_blocked_vjp.defvjp(_blocked_vjp_fwd, _blocked_vjp_bwd)


def blocked_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    block_rows_override: int | None = None,
) -> jax.Array:
  """The "blocked" implementation: [M, K] x [G, K, N] -> [M, N].

  Float operands get a grouped custom VJP (dlhs per tile, drhs per group; no
  [G, M, ...] intermediate anywhere). Integer operands (e.g. int8 with
  `preferred_element_type=jnp.int32`) are forward only: callers that train
  through them bring their own VJP.

  Args:
    lhs: [M, K], rows sorted by group.
    rhs: [G, K, N].
    group_sizes: <int>[G].
    preferred_element_type: as for `jax.lax.dot_general`; the output dtype.
    block_rows_override: the row-tile size; default `block_rows(M, G)`.
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
  if jnp.issubdtype(out_dtype, jnp.inexact):
    return _blocked_vjp(lhs, rhs, group_sizes, bm, out_dtype)
  return _blocked_rows(lhs, rhs, group_sizes, bm, False, out_dtype)


# ----------------------------------------------------------------------------
# "kernel": accelerator kernels, used when importable, never required.
#
# UNTESTED on real hardware: this project's CI is CPU-only. The TPU wrapper is
# exercised on CPU in Pallas interpret mode by the tests; the GPU one is not
# exercised at all.
# ----------------------------------------------------------------------------


def _megablox_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    interpret: bool = False,
) -> jax.Array:
  """TPU: Pallas megablox `gmm` (its own grouped VJP).

  megablox needs M to be a multiple of its row tile and leaves the rows past
  sum(group_sizes) unwritten, in the output and in the lhs gradient; the
  padding and the two row masks here make it match "ragged_dot".
  """
  from jax.experimental.pallas.ops.tpu import megablox

  m, k = lhs.shape
  n = rhs.shape[2]
  tm = min(128, -(-m // 8) * 8)
  padded_m = -(-m // tm) * tm
  valid = lax.iota(jnp.int32, m) < jnp.sum(group_sizes)
  x = jnp.where(valid[:, None], lhs, 0)  # masks garbage out of dlhs
  x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
  out = megablox.gmm(
      x,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type or lhs.dtype,
      (tm, min(128, k), min(128, n)),
      None,
      None,
      False,
      interpret,
  )
  return jnp.where(valid[:, None], out[:m], 0)


def _tokamax_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
) -> jax.Array:
  """GPU: Tokamax `ragged_dot` (Pallas Mosaic GPU / Triton kernels).

  Tokamax falls back to XLA's ragged_dot itself where its kernels do not
  support the case.
  """
  import tokamax

  return tokamax.ragged_dot(
      lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type=preferred_element_type,
  )


def _find_kernel(backend: str, dtypes: tuple[Any, ...] = ()):
  """(kernel, None) if one is usable here, else (None, why not)."""
  if backend == "tpu":
    if any(
        jnp.dtype(d) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
        for d in dtypes
    ):
      return None, f"megablox gmm takes float32/bfloat16 only, not {dtypes}"
    try:
      from jax.experimental.pallas.ops.tpu import megablox  # noqa: F401
    except ImportError as e:
      return None, f"jax.experimental.pallas.ops.tpu.megablox: {e}"
    return _megablox_gmm, None
  if backend == "gpu":
    try:
      import tokamax  # noqa: F401
    except ImportError as e:
      return None, f"tokamax (pip install tokamax): {e}"
    return _tokamax_ragged_dot, None
  return None, f"no grouped-matmul kernel is known for backend {backend!r}"


def resolve_implementation(
    implementation: str,
    backend: str | None = None,
    dtypes: tuple[Any, ...] = (),
) -> str:
  """Maps "auto" to the fastest implementation available on `backend`.

  Args:
    implementation: one of `IMPLEMENTATIONS`.
    backend: "cpu", "gpu" or "tpu"; default `jax.default_backend()`.
    dtypes: operand dtypes, when known (kernels take only some).

  Raises:
    ValueError: for an unknown implementation, or "kernel" where no kernel is
      usable (the message says what is missing).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"Unknown grouped matmul implementation {implementation!r}; allowed: "
        f"{IMPLEMENTATIONS}."
    )
  if implementation in ("ragged_dot", "blocked"):
    return implementation
  backend = backend or jax.default_backend()
  kernel, missing = _find_kernel(backend, dtypes)
  if implementation == "kernel" and kernel is None:
    raise ValueError(
        f"Grouped matmul implementation 'kernel' is unavailable: {missing}. "
        "Available here: 'ragged_dot', 'blocked' (and 'auto')."
    )
  if implementation == "kernel" or kernel is not None:
    return "kernel"
  return "blocked" if backend == "cpu" else "ragged_dot"


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: str = "auto",
    preferred_element_type=None,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N]; see the module docstring."""
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
        "grouped_matmul expects lhs [M, K] and rhs [G, K, N] with the same K; "
        f"got {lhs.shape} and {rhs.shape}."
    )
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(
        f"group_sizes must have shape [G]=({rhs.shape[0]},); got "
        f"{group_sizes.shape}."
    )
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
        f"group_sizes must be integers; got dtype {group_sizes.dtype}."
    )
  impl = resolve_implementation(implementation, dtypes=(lhs.dtype, rhs.dtype))
  if impl == "ragged_dot":
    return ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  if impl == "blocked":
    return blocked_grouped_matmul(
        lhs, rhs, group_sizes, preferred_element_type=preferred_element_type
    )
  kernel, _ = _find_kernel(jax.default_backend(), (lhs.dtype, rhs.dtype))
  return kernel(lhs, rhs, group_sizes, preferred_element_type)
