"""A decode-sized expert projection for NVIDIA GPUs (Pallas' Triton
backend): T <= 64 token-assignments, each times its own expert's weight,
reading each distinct routed expert's weights once. UNMEASURED: no GPU has
run it; nothing selects it by default (`registry.find_decode` loads it by
name).

  decode_matmul         x [T, K], w [E, K, N], expert_ids <int32>[T]
                        -> [T, N]: out[t] = x[t] @ (w[ids[t]] * scale[ids[t]])
  decode_experts        the gated expert MLP of B tokens' top-k choices
                        through three `decode_matmul`s, combined with the
                        routing weights.

Why not the grouped matmul: at decode a step's T = batch x top-k rows
(2-64) meet a grouped matmul whose row tile is 128; the sorted path also
sorts and gathers, and the layer's small-batch paths read every expert
(`sparse.every_expert`) or, in float, gather the chosen ones
(`sparse.chosen_experts`: T x k experts' weights taken, an expert chosen
twice taken twice, into a copy a kernel call then reads again). Here one
program per (distinct expert, N tile) loops
over K, loading its expert's [block_k, block_n] weight tile once for all
the rows routed to it (the rows it does not own masked to zero): the
weights are read once, the rows (T x K, tiny) once per N tile.

Slots. `expert_slots` lists the distinct valid expert ids, in order, in a
static T slots (at most T can be distinct); the grid is (T + 1) slots x N
tiles. Slot u < count multiplies for its expert; slot `count`, the tail,
stores zeros in the rows whose id is out of [0, E) (under `jit` ids cannot
be checked: those rows come out 0, as a row of no group does in the
grouped matmul); the slots past it return at once.

Weights in their stored type: bfloat16, float16, float32, int8 or float8
(e4m3fn, e5m2), converted to the product's type in registers (int8 and
float8 values are exact in bfloat16), never as a dequantized copy in HBM.
`scale` [E, N] float32 (int8 serving's per-expert, per-channel scales,
`stored_weights`' [E, 1, N] reshaped) multiplies the float32 accumulator
once per column: x @ (w * s) = (x @ w) * s. A per-tensor scale (fp8
serving's [1]) is applied to the tiny output outside the kernel. The
product is weight-only: the serving layer's contractions also quantize the
input (int8 per row, fp8 with its input scale); a caller that wants those
numbers quantizes x first (T x K values; int8 and float8 values are exact
in bfloat16) and applies the input's scale after: `decode_stored`.

The product runs in bfloat16 (float16) when x is and the weights are that
type or stored (int8, float8), else in float32 at full precision; it
accumulates in float32. Dimensions need not be multiples of the tiles
(masked loads and stores). Tiles are unmeasured defaults.
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from linen_moe._src.kernels.gpu import triton_gmm
from linen_moe._src.kernels.gpu.triton_tiles import Tiles

_F32 = jnp.float32
# The most token-assignments (tokens x top-k) a call takes: one row block
# of at most this many rows holds them all.
MAX_ROWS = 64
X_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, _F32))
W_DTYPES = (
    *X_DTYPES,
    jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn),
    jnp.dtype(jnp.float8_e5m2),
)
# Unmeasured: 128 output columns a program, 64-deep K steps, 4 warps, 4
# stages (a stage holds 64 x 128 weights plus 64 x 64 rows: 24 KiB in
# bfloat16). block_m and group_m are not read (the rows are one block).
DEFAULT_TILES = Tiles(block_m=64, block_n=128, block_k=64)
TITLE = "the Pallas-Triton decode expert matmul"


def _names(dtypes) -> str:
  return ", ".join(d.name for d in dtypes)


def check_operands(x, w, expert_ids, scale, preferred_element_type):
  """Checks ranks, shapes, dtypes, T and concrete expert ids, before any
  work; returns the output dtype.

  Raises:
    ValueError: a rank or shape that does not fit, T past `MAX_ROWS`,
      concrete expert ids out of [0, E).
    TypeError: a dtype the kernel does not take.
  """
  if x.ndim != 2:
    raise ValueError(f"x [T, K] must have rank 2; got shape {x.shape}.")
  if w.ndim != 3:
    raise ValueError(f"w [E, K, N] must have rank 3; got shape {w.shape}.")
  (t, k), (e, wk, n) = x.shape, w.shape
  if wk != k:
    raise ValueError(
        f"w [E, K, N] must have the same K as x [T, K]; got w {w.shape}, "
        f"x {x.shape}."
    )
  if expert_ids.shape != (t,):
    raise ValueError(
        f"expert_ids must have shape [T]={(t,)}; got {expert_ids.shape}."
    )
  if not 1 <= t <= MAX_ROWS:
    raise ValueError(
        f"x has T={t} rows; the decode matmul takes 1 to {MAX_ROWS} "
        "token-assignments (tokens x top-k): use the grouped matmul."
    )
  if jnp.dtype(x.dtype) not in X_DTYPES:
    raise TypeError(
        f"x has dtype {jnp.dtype(x.dtype).name}; {TITLE} takes "
        f"{_names(X_DTYPES)}."
    )
  if jnp.dtype(w.dtype) not in W_DTYPES:
    raise TypeError(
        f"w has dtype {jnp.dtype(w.dtype).name}; {TITLE} takes "
        f"{_names(W_DTYPES)}."
    )
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(
        f"expert_ids must be integers; got {jnp.dtype(expert_ids.dtype).name}."
    )
  if scale is not None:
    if jnp.dtype(scale.dtype) != _F32:
      raise TypeError(
          f"scale must be float32; got {jnp.dtype(scale.dtype).name}."
      )
    allowed = ((e, n), (e, 1, n), (1,), ())
    if tuple(scale.shape) not in allowed:
      raise ValueError(
          "scale must have shape [E, N], [E, 1, N] (per channel) or [1], "
          f"() (per tensor), one of {allowed}; got {tuple(scale.shape)}."
      )
  if jnp.dtype(w.dtype) not in X_DTYPES[:3] and scale is None:
    raise ValueError(
        f"w has dtype {jnp.dtype(w.dtype).name}, a stored type: pass its "
        "scale (scale=None is for float weights)."
    )
  out = jnp.dtype(preferred_element_type or x.dtype)
  if out not in X_DTYPES:
    raise TypeError(
        f"preferred_element_type={out.name}; {TITLE} writes {_names(X_DTYPES)}."
    )
  if not isinstance(expert_ids, jax.core.Tracer):
    ids = jax.device_get(expert_ids)
    bad = ids[(ids < 0) | (ids >= e)]
    if bad.size:
      raise ValueError(
          f"expert_ids must be in [0, {e}) (the E experts of w); got "
          f"{bad.tolist()}."
      )
  return out


def expert_slots(expert_ids: jax.Array, num_experts: int):
  """The distinct valid expert ids of `expert_ids`, in T static slots.

  Args:
    expert_ids: <int>[T], ids out of [0, E) count as no expert.
    num_experts: E.

  Returns:
    (slots <int32>[T]: the distinct ids in increasing order, then E;
    count <int32>[1]: how many are distinct).
  """
  t = expert_ids.shape[0]
  ids = expert_ids.astype(jnp.int32)
  valid = (ids >= 0) & (ids < num_experts)
  ordered = jnp.sort(jnp.where(valid, ids, num_experts))
  first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  first &= ordered < num_experts
  at = jnp.where(first, jnp.cumsum(first) - 1, t)
  slots = (
      jnp.full((t,), num_experts, jnp.int32).at[at].set(ordered, mode="drop")
  )
  return slots, jnp.sum(first, dtype=jnp.int32)[None]


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "interpret"))
def decode_kernel(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    scale: jax.Array | None,
    *,
    tiles: Tiles,
    out_dtype,
    interpret: bool = False,
) -> jax.Array:
  """x [T, K], w [E, K, N], expert_ids <int32>[T], scale <f32>[E, N] or
  None -> [T, N] in `out_dtype`; rows of ids out of [0, E) zero. No
  argument checks (`decode_matmul` makes them)."""
  (t, k), (e, _, n) = x.shape, w.shape
  bt = triton_gmm.block(MAX_ROWS, t)
  bk, bn = triton_gmm.block(tiles.block_k, k), triton_gmm.block(
      tiles.block_n, n
  )
  tiles_k, tiles_n = pl.cdiv(k, bk), pl.cdiv(n, bn)
  slots, count = expert_slots(expert_ids, e)
  # int8 and float8 values are exact in x's type; float weights join the
  # choice (float32 weights with bfloat16 rows multiply in float32).
  stored = jnp.dtype(w.dtype) not in X_DTYPES
  dtype = triton_gmm.compute_dtype(x.dtype, *(() if stored else (w.dtype,)))
  scaled = scale is not None
  within, mask, load = triton_gmm._within, triton_gmm._mask, triton_gmm._load  # noqa: SLF001

  def kernel(slots_ref, count_ref, ids_ref, x_ref, w_ref, *rest):
    s_ref, out = rest if scaled else (None, *rest)
    u, j = jnp.divmod(pl.program_id(0), tiles_n)
    n0 = j * bn
    n_ok = within(n0, bn, n)
    ids = ids_ref[...]

    @pl.when(u < count_ref[0])
    def _():
      ex = slots_ref[u]
      mine = ids == ex

      def step(kk, acc):
        k0 = kk * bk
        k_ok = within(k0, bk, k)
        a = load(x_ref.at[:, pl.ds(k0, bk)], mask(mine, k_ok, (bt, bk)))
        b = load(
            w_ref.at[ex, pl.ds(k0, bk), pl.ds(n0, bn)],
            mask(k_ok, n_ok, (bk, bn)),
        )
        return acc + lax.dot_general(
            a.astype(dtype),
            b.astype(
                dtype
            ),  # int8 / float8 -> the product's type, in registers
            (((1,), (0,)), ((), ())),
            precision=triton_gmm._precision(dtype),  # noqa: SLF001
            preferred_element_type=_F32,
        )

      acc = lax.fori_loop(0, tiles_k, step, jnp.zeros((bt, bn), _F32))
      if scaled:
        acc = acc * load(s_ref.at[ex, pl.ds(n0, bn)], n_ok)[None, :]
      plgpu.store(
          out.at[:, pl.ds(n0, bn)],
          acc.astype(out.dtype),
          mask=mask(mine, n_ok, (bt, bn)),
      )

    @pl.when(u == count_ref[0])
    def _():
      nobody = (ids < 0) | (ids >= e)
      plgpu.store(
          out.at[:, pl.ds(n0, bn)],
          jnp.zeros((bt, bn), out.dtype),
          mask=mask(nobody, n_ok, (bt, bn)),
      )

  itemsize = jnp.dtype(w.dtype).itemsize
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((bt, n), out_dtype),
      grid=((t + 1) * tiles_n,),
      compiler_params=triton_gmm._params(tiles),  # noqa: SLF001
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=2 * t * k * n,
          transcendentals=0,
          # At most T distinct experts' weights, each read once.
          bytes_accessed=min(t, e) * k * n * itemsize
          + x.size * jnp.dtype(x.dtype).itemsize * tiles_n
          + t * n * jnp.dtype(out_dtype).itemsize,
      ),
      name="linen_moe_triton_decode",
  )
  # The rows padded to the row block (a static slice may not pass the
  # array's end); the padding's id -1 is no expert's: its rows get zeros.
  ids = jnp.pad(expert_ids.astype(jnp.int32), (0, bt - t), constant_values=-1)
  operands = (slots, count, ids, jnp.pad(x, ((0, bt - t), (0, 0))), w)
  return call(*operands, *((scale,) if scaled else ()))[:t]


def decode_matmul(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    scale: jax.Array | None = None,
    preferred_element_type=None,
    *,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
  """out[t] = x[t] @ (w[ids[t]] * scale[ids[t]]), each distinct expert's
  weights read once (UNMEASURED; see the module docstring). Forward only
  (decoding).

  Args:
    x: [T, K] float16, bfloat16 or float32, 1 <= T <= `MAX_ROWS`.
    w: [E, K, N] in `W_DTYPES` (float, int8, float8 e4m3fn / e5m2).
    expert_ids: <int>[T], each row's expert; concrete ones must be in
      [0, E), traced ones out of it give a zero row.
    scale: float32 [E, N] or [E, 1, N] (per expert and output channel),
      [1] or () (per tensor), or None (float weights only).
    preferred_element_type: the output dtype (float16, bfloat16, float32);
      default x's.
    tiles: block_n, block_k, num_warps, num_stages (`DEFAULT_TILES`).
    interpret: run in Pallas interpret mode (any backend).

  Returns:
    [T, N].

  Raises:
    ValueError, TypeError: `check_operands`, and tiles that do not fit.
  """
  out_dtype = check_operands(x, w, expert_ids, scale, preferred_element_type)
  tiles = DEFAULT_TILES if tiles is None else tiles
  if not isinstance(tiles, Tiles):
    raise ValueError(f"tiles must be a Tiles or None; got {tiles!r}.")
  tiles.check("tiles")
  e, _, n = w.shape
  per_tensor = scale is not None and scale.size == 1
  channel = None if scale is None or per_tensor else scale.reshape(e, n)
  if x.shape[1] == 0 or n == 0:
    return jnp.zeros((x.shape[0], n), out_dtype)
  kernel_dtype = _F32 if per_tensor else out_dtype
  out = decode_kernel(
      x,
      w,
      expert_ids,
      channel,
      tiles=tiles,
      out_dtype=kernel_dtype,
      interpret=interpret,
  )
  if per_tensor:
    out = out * scale.reshape(())
  return out.astype(out_dtype)


Weight = jax.Array | tuple[jax.Array, jax.Array]


def decode_experts(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    wi_0: Weight,
    wi_1: Weight,
    wo: Weight,
    act: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    *,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
  """The gated expert MLP of B tokens' top-k choices, the decode kernel's
  way: out[b] = sum_j weights[b, j] * (act(x_b W0) * (x_b W1)) Wo, each of
  expert indices[b, j]'s; the result of the layer's sparse path.

  Args:
    x: [B, M], B * k <= `MAX_ROWS`.
    indices: <int>[B, k] routed experts; weights: [B, k] their weights.
    wi_0, wi_1: [E, M, H]; wo: [E, H, M]; each an array or a (stored
      values, scale) pair as `decode_matmul` takes them.
    act: the gate's activation.
    tiles, interpret: `decode_matmul`'s.

  Returns:
    [B, M] in x's dtype.
  """
  b, k = indices.shape
  rows = jnp.repeat(x, k, axis=0)  # [B * k, M]: row b * k + j
  ids = indices.reshape(b * k)

  def project(operand, weight):
    w, scale = weight if isinstance(weight, tuple) else (weight, None)
    return decode_matmul(
        operand, w, ids, scale, tiles=tiles, interpret=interpret
    )

  hidden = act(project(rows, wi_0)) * project(rows, wi_1)  # [B * k, H]
  out = project(hidden, wo).reshape(b, k, -1)  # [B, k, M]
  return jnp.einsum("BKM,BK->BM", out, weights.astype(x.dtype))
