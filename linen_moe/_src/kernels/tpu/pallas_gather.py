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

The "vmem" form also backs two gathers that do more with the rows while
they are in VMEM: `gather_scale_dot` (each row scaled, and its dot product
with another row) and `gather_sum` (each output row the weighted sum of
k gathered rows).

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
# Row copies issued per loop iteration of `gather_rows`: on a v5e the
# dispatch's gather ([32768, 2048] bf16 -> 262,144 rows) takes 6.33 ms at 8,
# 6.04 at 16, 5.93 at 32 (benchmarks/device/bench_gather.py --unrolls).
DEFAULT_UNROLL = 32


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
    valid_ref,
    idx_ref,
    next_idx_ref,
    table,
    *refs,
    tm,
    unroll,
    num_inputs,
    store,
):
  """Grid step i: rows of block i + 1 start into the free slot, block i's
  are waited for and handed to `store` (unpacked, and zeroed past `valid`
  where the block straddles it); Pallas writes its output blocks back.

  `refs` are `num_inputs` more input blocks, the output blocks, then the
  scratch (the row buffer, its semaphores). `store(rows, inputs, outputs)`
  writes block i's outputs from its rows <[tm, M]>; `store(None, inputs,
  outputs)` a block wholly past `valid`.
  """
  inputs, outputs = refs[:num_inputs], refs[num_inputs:-2]
  buf, sem = refs[-2:]
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
  dtype = outputs[0].dtype

  def rows():
    got = buf[slot]
    return got if got.dtype == dtype else _unpack_halves(got, dtype)

  @pl.when(base < valid)
  def _():
    pltpu.make_async_copy(buf.at[slot], buf.at[slot], sem.at[slot]).wait()

    @pl.when(base + tm <= valid)
    def _():
      store(rows(), inputs, outputs)

    @pl.when(base + tm > valid)
    def _():
      row = base + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
      store(jnp.where(row < valid, rows(), 0).astype(dtype), inputs, outputs)

  @pl.when(base >= valid)
  def _():
    store(None, inputs, outputs)


def _store_rows(rows, inputs, outputs):
  """The plain gather: the rows themselves (zeros past `valid`)."""
  del inputs
  (out,) = outputs
  out[...] = jnp.zeros(out.shape, out.dtype) if rows is None else rows


def _store_scaled_and_dot(rows, inputs, outputs):
  """`gather_scale_dot`: each row times its scale, and its dot product with
  the other operand's row, in float32."""
  scale, other = inputs
  out, dot = outputs
  if rows is None:
    out[...] = jnp.zeros(out.shape, out.dtype)
    dot[...] = jnp.zeros(dot.shape, dot.dtype)
    return
  rows = rows.astype(jnp.float32)
  out[...] = (rows * scale[...].astype(jnp.float32)).astype(out.dtype)
  dot[...] = jnp.sum(
      rows * other[...].astype(jnp.float32), axis=1, keepdims=True
  )


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
    unroll: int = DEFAULT_UNROLL,
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
    unroll: row copies issued per loop iteration (1 when interpreted: the
      same copies, a smaller program to compile).

  Returns:
    [R, M] in `table`'s dtype.
  """
  if via not in VIAS:
    raise ValueError(f"via must be one of {VIAS}; got {via!r}.")
  rows, width = index.shape[0], table.shape[1]
  itemsize = jnp.dtype(table.dtype).itemsize
  tm, idx = _blocks(table, index, block_rows, "gather_rows")
  if rows == 0:
    return jnp.zeros((0, width), table.dtype)
  num_blocks = idx.shape[0]
  valid = rows if valid is None else valid
  valid = jnp.minimum(jnp.asarray(valid, jnp.int32), rows).reshape(1)
  unroll = 1 if interpret else min(unroll, tm)
  any_space = pl.BlockSpec(memory_space=pl.ANY)
  if via == "vmem":
    return _vmem_call(
        table,
        idx,
        valid,
        (),
        (),
        [(width, table.dtype)],
        _store_rows,
        tm=tm,
        rows=rows,
        unroll=unroll,
        interpret=interpret,
    )[0]
  if itemsize != 4:
    raise ValueError(
        f'via="hbm" copies 32-bit rows only; got {table.dtype} (Mosaic '
        "refuses a single-row slice of a 16-bit array)."
    )
  kernel = functools.partial(_hbm_kernel, tm=tm, rows=rows, unroll=unroll)
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
          in_specs=[_index_block(tm, lambda i, v: (i, 0, 0)), any_space],
          out_specs=any_space,
          scratch_shapes=scratch,
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=0, transcendentals=0, bytes_accessed=2 * moved + 4 * rows
      ),
      name="linen_moe_gather_hbm",
  )(valid, idx, table)


def _index_block(tm: int, index_map) -> pl.BlockSpec:
  """One grid step's [1, tm] indices in SMEM (an SMEM block is whole in
  its last 2 dims)."""
  return pl.BlockSpec((None, 1, tm), index_map, memory_space=pltpu.SMEM)


def _check_table(table, name) -> None:
  """Raises a `ValueError` (naming `name`, the caller) for a table the DMA
  copies cannot move: not [N, M], or neither 32-bit nor 16-bit of an even
  width."""
  if table.ndim != 2:
    raise ValueError(f"{name} takes table [N, M]; got {table.shape}.")
  width = table.shape[1]
  itemsize = jnp.dtype(table.dtype).itemsize
  if itemsize not in (2, 4) or (itemsize == 2 and width % 2):
    raise ValueError(
        f"{name} takes 32-bit tables, or 16-bit ones of an even width; "
        f"got {table.dtype} [{table.shape[0]}, {width}]."
    )


def _blocks(table, index, block_rows, name) -> tuple[int, jax.Array]:
  """(rows per block tm, <int32>[blocks, 1, tm] `index` padded) of a
  gather, after checking `table` [N, M], `index` [R] and `block_rows`
  (`name` the caller's, for the errors)."""
  if index.ndim != 1:
    raise ValueError(f"{name} takes index [R]; got {index.shape}.")
  if block_rows <= 0 or block_rows % 32:
    raise ValueError(
        f"block_rows must be a positive multiple of 32; got {block_rows}."
    )
  _check_table(table, name)
  rows = index.shape[0]
  tm = min(block_rows, max(-(-rows // 32) * 32, 32))
  num_blocks = -(-rows // tm)
  idx = jnp.pad(index.astype(jnp.int32), (0, num_blocks * tm - rows))
  return tm, idx.reshape(num_blocks, 1, tm)  # SMEM blocks: whole in 2 dims


def _vmem_call(
    table,
    idx,
    valid,
    inputs,
    input_widths,
    outputs,
    store,
    *,
    tm,
    rows,
    unroll,
    interpret,
    name="linen_moe_gather_vmem",
    block_out=None,
):
  """The "vmem" form's `pallas_call`: rows of `table` by `idx` <[blocks,
  1, tm]> into VMEM, handed to `store` with each grid step's blocks of
  `inputs` ([R, w] arrays, w from `input_widths`) and of the outputs
  (`outputs`: (width, dtype) of each [R, width] result), `block_out`
  rows each (default tm). Returns the outputs."""
  num_blocks = idx.shape[0]
  out_rows = block_out or tm
  row_block = lambda w: pl.BlockSpec((out_rows, w), lambda i, v: (i, 0))  # noqa: E731
  packed = _pack_halves(table) if table.dtype.itemsize == 2 else table
  kernel = functools.partial(
      _vmem_kernel,
      tm=tm,
      unroll=unroll,
      num_inputs=len(inputs),
      store=store,
  )
  moved = idx.size * table.shape[1] * table.dtype.itemsize
  moved += sum(x.size * x.dtype.itemsize for x in inputs)
  moved += sum(rows * w * jnp.dtype(d).itemsize for w, d in outputs)
  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((rows, w), d) for w, d in outputs],
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(num_blocks,),
          in_specs=[
              _index_block(tm, lambda i, v: (i, 0, 0)),
              _index_block(
                  tm, lambda i, v: (jnp.minimum(i + 1, num_blocks - 1), 0, 0)
              ),
              pl.BlockSpec(memory_space=pl.ANY),
              *[row_block(w) for w in input_widths],
          ],
          out_specs=[row_block(w) for w, _ in outputs],
          scratch_shapes=[
              pltpu.VMEM((2, tm, packed.shape[1]), packed.dtype),
              pltpu.SemaphoreType.DMA((2,)),
          ],
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=0, transcendentals=0, bytes_accessed=moved + 4 * rows
      ),
      name=name,
  )(valid, idx, idx, packed, *inputs)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def gather_scale_dot(
    table: jax.Array,
    index: jax.Array,
    scale: jax.Array,
    other: jax.Array,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Gathered rows scaled, and their dot products with other rows, in one
  pass: with g = table[index] <[R, M]>,

    scaled[r] = g[r] * scale[r]           (in float32, then table's dtype)
    dot[r] = sum_m g[r, m] * other[r, m]  (float32)

  The sparse path's combine backward (`layer/permute.py`): table the
  output's cotangent [T, M], scale the combine weight of each sorted row,
  other the expert outputs [R, M]; the gathered [R, M] rows never go to
  HBM.

  Args:
    table: [N, M], a 16-bit float or float32.
    index: <int>[R], rows of `table`.
    scale: [R], any float dtype (taken as float32).
    other: [R, M].
    block_rows: rows per grid step (a multiple of 32).
    interpret: run the Pallas interpreter (on a CPU).

  Returns:
    (scaled [R, M] in `table`'s dtype, dot <float32>[R]).
  """
  rows, width = index.shape[0], table.shape[-1]
  if scale.shape != (rows,) or other.shape != (rows, width):
    raise ValueError(
        f"gather_scale_dot takes scale [{rows}] and other [{rows}, {width}]"
        f" for index [{rows}] and table [N, {width}]; got {scale.shape} and"
        f" {other.shape}."
    )
  tm, idx = _blocks(table, index, block_rows, "gather_scale_dot")
  if rows == 0:
    return jnp.zeros((0, width), table.dtype), jnp.zeros((0,), jnp.float32)
  valid = jnp.full((1,), rows, jnp.int32)
  scaled, dot = _vmem_call(
      table,
      idx,
      valid,
      (scale.astype(jnp.float32).reshape(rows, 1), other),
      (1, width),
      [(width, table.dtype), (1, jnp.float32)],
      _store_scaled_and_dot,
      tm=tm,
      rows=rows,
      unroll=min(8, tm),
      interpret=interpret,
      name="linen_moe_gather_scale_dot",
  )
  return scaled, dot.reshape(rows)


def _store_weighted_sum(k: int):
  """`gather_sum`'s store: block i's rows arrive choice-major (choice j of
  its token r at row j * tm + r); each token's k rows, weighted, summed in
  float32."""

  def store(rows, inputs, outputs):
    (weights,) = inputs
    (out,) = outputs
    if rows is None:  # never: every block is valid
      out[...] = jnp.zeros(out.shape, out.dtype)
      return
    tm = out.shape[0]
    w = weights[...]
    total = jnp.zeros(out.shape, jnp.float32)
    for j in range(k):
      row = rows[j * tm : (j + 1) * tm].astype(jnp.float32)
      wj = w[:, j : j + 1]
      total += jnp.where(wj != 0, row * wj, 0.0)
    out[...] = total.astype(out.dtype)

  return store


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def gather_sum(
    table: jax.Array,
    index: jax.Array,
    weights: jax.Array,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    interpret: bool = False,
) -> jax.Array:
  """Each output row the weighted sum of k gathered rows, in one pass:

    out[t] = sum_j weights[t, j] * table[index[t, j]]   (float32 sums)

  a term whose weight is 0 adds 0 whatever its row holds. The sparse
  path's combine (table the expert outputs [R, M], the routing weights)
  and its dispatch's backward (weights 1 or 0): XLA's k gathers of [T, M]
  rows and their sum, without the gathered rows ever in HBM.

  Args:
    table: [N, M], a 16-bit float or float32.
    index: <int>[T, k], rows of `table` (clamped into [0, N)).
    weights: [T, k], any float dtype (taken as float32).
    block_rows: rows gathered per grid step, about: a step takes
      block_rows // k tokens, rounded down to a multiple of 8 (at least 8).
    interpret: run the Pallas interpreter (on a CPU).

  Returns:
    [T, M] in `table`'s dtype.

  Raises:
    ValueError: shapes that do not fit, a table `_check_table` refuses.
  """
  if index.ndim != 2 or weights.shape != index.shape:
    raise ValueError(
        "gather_sum takes index [T, k] and weights of its shape; got "
        f"{index.shape} and {weights.shape}."
    )
  t, k = index.shape
  tokens = max(8, block_rows // max(k, 1) // 8 * 8)  # per grid step
  tokens = min(tokens, -(-t // 8) * 8)
  _check_table(table, "gather_sum")
  if t == 0 or k == 0:
    return jnp.zeros((t, table.shape[-1]), table.dtype)
  blocks = -(-t // tokens)
  # Choice-major within each block: row j * tokens + r is token r's choice j.
  idx = jnp.pad(index.astype(jnp.int32), ((0, blocks * tokens - t), (0, 0)))
  idx = idx.reshape(blocks, tokens, k).transpose(0, 2, 1)
  # Every block is whole for the kernel (no row zeroed): the padded
  # tokens' rows are row 0's, and Pallas drops their outputs.
  every_row = jnp.full((1,), blocks * tokens * k, jnp.int32)
  (out,) = _vmem_call(
      table,
      idx.reshape(blocks, 1, tokens * k),
      every_row,
      (weights.astype(jnp.float32),),
      (k,),
      [(table.shape[-1], table.dtype)],
      _store_weighted_sum(k),
      tm=tokens * k,
      rows=t,
      unroll=8,
      interpret=interpret,
      name="linen_moe_gather_sum",
      block_out=tokens,
  )
  return out
