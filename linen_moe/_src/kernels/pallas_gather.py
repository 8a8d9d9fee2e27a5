"""Row gathers on a TPU by DMA: out[r] = table[index[r]], [N, M] -> [R, M].

XLA's TPU gather moves rows at ~245 GB/s on a v5e (0.3 of its HBM
roofline) at the MoE dispatch's sizes ([32768, 2048] bf16 table, 262,144
rows). Here each row is one DMA, issued from indices held in SMEM, many in
flight at once; no vector unit touches the data.

Two forms, `via`:
  "vmem"  rows land in a VMEM block of `block_rows` rows (double-buffered,
          the next block's rows in flight while the last one is written),
          and each whole block goes back to HBM as one DMA.
  "hbm"   rows go HBM to HBM, one DMA each; a block's copies are waited for
          one block later, so two blocks are in flight.

Rows at and past `valid` come out as zeros (a block wholly past it issues
no row copies; one straddling it copies its rows, then zeroes them). An
index outside [0, N) is clamped into it, as XLA's gather clamps.

Knows nothing of MoE; `layer/permute.py` decides where it runs.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

VIAS = ("vmem", "hbm")
DEFAULT_VIA = "vmem"
DEFAULT_BLOCK_ROWS = 256


def _row_copy(src, src_row, dst, dst_row, sem):
  src_row = jnp.minimum(jnp.maximum(src_row, 0), src.shape[0] - 1)
  return pltpu.make_async_copy(
      src.at[pl.ds(src_row, 1)], dst.at[pl.ds(dst_row, 1)], sem
  )


def _pack_halves(table: jax.Array) -> jax.Array:
  """bf16 / f16 [N, M] -> <uint32>[N, M / 2]: word c holds column c in its
  low half and column c + M / 2 in its high half. Mosaic copies rows of
  32-bit arrays only: a 16-bit array's rows are packed in pairs ((8,128)(2,1)
  tiles), and a single-row slice of one is refused."""
  half = table.shape[1] // 2
  bits = lambda x: lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)  # noqa: E731
  return bits(table[:, :half]) | (bits(table[:, half:]) << 16)


def _unpack_halves(words: jax.Array, dtype) -> jax.Array:
  """The inverse of `_pack_halves` on a block: <uint32>[n, M / 2] -> [n, M]."""
  lo = lax.bitcast_convert_type(words.astype(jnp.uint16), dtype)
  hi = lax.bitcast_convert_type((words >> 16).astype(jnp.uint16), dtype)
  return jnp.concatenate([lo, hi], axis=1)


def _vmem_kernel(
    valid_ref, idx_ref, next_idx_ref, table, out, buf, sem, *, tm, unroll
):
  """Grid step i: rows of block i + 1 start into the free slot, block i's
  are waited for and stored to the output block (unpacked, and masked
  where the block straddles `valid`); Pallas writes that block back."""
  i = pl.program_id(0)
  valid = valid_ref[0]
  slot = i % 2

  def start_rows(block, slot, idx):
    @pl.when(block * tm < valid)
    def _():
      def body(r, carry):
        _row_copy(table, idx[0, r], buf.at[slot], r, sem.at[slot]).start()
        return carry

      lax.fori_loop(0, tm, body, 0, unroll=unroll)

  @pl.when(i == 0)
  def _():
    start_rows(0, 0, idx_ref)

  @pl.when(i + 1 < pl.num_programs(0))
  def _():
    start_rows(i + 1, 1 - slot, next_idx_ref)

  base = i * tm

  def rows():
    got = buf[slot]
    return got if got.dtype == out.dtype else _unpack_halves(got, out.dtype)

  @pl.when(base < valid)
  def _():
    pltpu.make_async_copy(buf.at[slot], buf.at[slot], sem.at[slot]).wait()

    @pl.when(base + tm <= valid)
    def _():
      out[...] = rows()

    @pl.when(base + tm > valid)
    def _():
      row = base + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
      out[...] = jnp.where(row < valid, rows(), 0).astype(out.dtype)

  @pl.when(base >= valid)
  def _():
    out[...] = jnp.zeros(out.shape, out.dtype)


def _hbm_kernel(
    valid_ref, idx_ref, table, out, zeros, sem, *, tm, rows, unroll
):
  """Grid step i: block i's rows start HBM to HBM (zeros past `valid`),
  then block i - 1's are waited for; the last step waits for its own."""
  i = pl.program_id(0)
  num_blocks = pl.num_programs(0)
  last = rows - (rows - 1) // tm * tm
  valid = valid_ref[0]
  slot = i % 2
  base = i * tm

  @pl.when(i == 0)
  def _():
    zeros[...] = jnp.zeros(zeros.shape, zeros.dtype)

  def start_rows(n):
    def body(r, carry):
      @pl.when(base + r < valid)
      def _():
        _row_copy(table, idx_ref[0, r], out, base + r, sem.at[slot]).start()

      @pl.when(base + r >= valid)
      def _():
        _row_copy(zeros, r, out, base + r, sem.at[slot]).start()

      return carry

    lax.fori_loop(0, n, body, 0, unroll=unroll)

  def wait_block(slot, n):
    pltpu.make_async_copy(
        out.at[pl.ds(0, n)], out.at[pl.ds(0, n)], sem.at[slot]
    ).wait()

  @pl.when(i + 1 < num_blocks)
  def _():
    start_rows(min(tm, rows))

  @pl.when(i + 1 == num_blocks)
  def _():
    start_rows(last)

  @pl.when(i >= 1)
  def _():
    wait_block(1 - slot, min(tm, rows))

  @pl.when(i + 1 == num_blocks)
  def _():
    wait_block(slot, last)


@functools.partial(
    jax.jit, static_argnames=("block_rows", "via", "interpret", "unroll")
)
def gather_rows(
    table: jax.Array,
    index: jax.Array,
    valid: jax.Array | int | None = None,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    via: str = DEFAULT_VIA,
    interpret: bool = False,
    unroll: int = 8,
) -> jax.Array:
  """table [N, M], index <int32>[R] -> [R, M]: row r is table[index[r]] for
  r < valid, zeros from `valid` on.

  Args:
    table: [N, M], any dtype.
    index: <int>[R], rows of `table`; past `valid` never read as rows.
    valid: rows to gather (a scalar, traced or not), the rest zeros; None
      for all R.
    block_rows: rows per grid step (a multiple of 32).
    via: "vmem" or "hbm" (the module docstring).
    interpret: run the Pallas interpreter (on a CPU).
    unroll: row copies issued per loop iteration.

  Returns:
    [R, M] in `table`'s dtype.
  """
  if table.ndim != 2 or index.ndim != 1:
    raise ValueError(
        f"gather_rows takes table [N, M] and index [R]; got {table.shape} "
        f"and {index.shape}."
    )
  if via not in VIAS:
    raise ValueError(f"via must be one of {VIAS}; got {via!r}.")
  if block_rows <= 0 or block_rows % 32:
    raise ValueError(
        f"block_rows must be a positive multiple of 32; got {block_rows}."
    )
  rows, width = index.shape[0], table.shape[1]
  itemsize = jnp.dtype(table.dtype).itemsize
  if itemsize not in (2, 4) or (itemsize == 2 and width % 2):
    raise ValueError(
        "gather_rows takes 32-bit tables, or 16-bit ones of an even width; "
        f"got {table.dtype} [{table.shape[0]}, {width}]."
    )
  if rows == 0:
    return jnp.zeros((0, width), table.dtype)
  tm = min(block_rows, -(-rows // 32) * 32)
  num_blocks = -(-rows // tm)
  idx = jnp.pad(index.astype(jnp.int32), (0, num_blocks * tm - rows))
  idx = idx.reshape(num_blocks, 1, tm)  # an SMEM block is whole in 2 dims
  valid = rows if valid is None else valid
  valid = jnp.minimum(jnp.asarray(valid, jnp.int32), rows).reshape(1)
  smem_block = lambda f: pl.BlockSpec(  # noqa: E731
      (None, 1, tm), f, memory_space=pltpu.SMEM
  )
  any_space = pl.BlockSpec(memory_space=pl.ANY)
  kw = dict(tm=tm, rows=rows, unroll=min(unroll, tm))
  if via == "vmem":
    kernel = functools.partial(_vmem_kernel, tm=tm, unroll=kw["unroll"])
    in_specs = [
        smem_block(lambda i, v: (i, 0, 0)),
        smem_block(lambda i, v: (jnp.minimum(i + 1, num_blocks - 1), 0, 0)),
        any_space,
    ]
    packed = _pack_halves(table) if itemsize == 2 else table
    operands = (idx, idx, packed)
    out_spec = pl.BlockSpec((tm, width), lambda i, v: (i, 0))
    scratch = [
        pltpu.VMEM((2, tm, packed.shape[1]), packed.dtype),
        pltpu.SemaphoreType.DMA((2,)),
    ]
  else:
    if itemsize != 4:
      raise ValueError(
          f'via="hbm" copies 32-bit rows only; got {table.dtype} (Mosaic '
          "refuses a single-row slice of a 16-bit array)."
      )
    out_spec = any_space
    kernel = functools.partial(_hbm_kernel, **kw)
    in_specs = [smem_block(lambda i, v: (i, 0, 0)), any_space]
    operands = (idx, table)
    scratch = [
        pltpu.VMEM((tm, width), table.dtype),
        pltpu.SemaphoreType.DMA((2,)),
    ]
  moved = rows * width * itemsize
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((rows, width), table.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(num_blocks,),
          in_specs=in_specs,
          out_specs=out_spec,
          scratch_shapes=scratch,
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=0, transcendentals=0, bytes_accessed=2 * moved + 4 * rows
      ),
      name=f"linen_moe_gather_{via}",
  )(valid, *operands)
