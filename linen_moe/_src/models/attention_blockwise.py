"""Blockwise attention in plain JAX: memory linear in the sequence length,
forward and backward.

The queries are cut into blocks of `block_q` rows and the keys / values into
blocks of `block_k`; a scan over the query blocks runs a loop over the key
blocks with an online softmax (a running maximum m, sum l and unnormalised
output per query row), so no [S, T] score matrix exists, only one block's
[bq, bk] a time. The backward pass is a custom VJP in the FlashAttention-2
manner: the forward keeps the output and each row's log-sum-exp
(lse = m + log l), and the backward recomputes each block's probabilities
p = exp(s - lse) from them, scanning the key blocks (accumulating dK, dV of
the block) with a loop over the query blocks (accumulating dQ in place), so
it keeps no block's probabilities either.

Which keys a query sees is exactly `attention_mask.attention_mask` (causal by
positions, the window or chunk, the same segment), applied inside each
block. With `self_attention` (the keys are the queries' own tokens, and
each segment's positions count up by at least one per token: the
decoders' layout), key j is visible to query i only if j <= i and, with a
window W (or a chunk of W), i - j < W, so the loops visit only the key
blocks a query block can see: blocks wholly above the diagonal or wholly
behind the window are skipped, not masked. Without it every block is
visited (still linear memory).

Logits, the softmax statistics and every accumulator are float32; the
probabilities are cast to the compute `dtype` before they meet the values,
as `attention.attend`'s einsum reference does.

Shapes: B batch, S queries, T keys, N query heads, K key/value heads,
G = N / K, Dk query/key width, Dv value width; bq, bk the block sizes.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

# The default block sizes (the loops' trip counts fall with them; one
# block's f32 scores are N * bq * bk * 4 bytes a batch row).
BLOCK_Q = 512
BLOCK_K = 512

_PAD_QUERY = -2  # segment of padded query rows: they see no key
_PAD_KEY = -1  # segment of padded key rows: no query sees them


def _blocks(x: jax.Array, size: int, fill) -> jax.Array:
  """[B, L, ...] -> [L / size, B, size, ...], padded with `fill` to a
  multiple of `size`."""
  b, length = x.shape[:2]
  n = -(-length // size)
  pad = n * size - length
  if pad:
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, widths, constant_values=fill)
  x = x.reshape(b, n, size, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _unblock(x: jax.Array, length: int) -> jax.Array:
  """[n, B, size, ...] -> [B, length, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  x = x.reshape(x.shape[0], -1, *x.shape[3:])
  return x[:, :length]


# `static`: (window, chunk, scale, dtype, bq, bk, skip), hashable.
@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attend_blocks(qb, kb, vb, qpos, kpos, qseg, kseg, sinks, static):
  out, _ = _forward(qb, kb, vb, qpos, kpos, qseg, kseg, sinks, static)
  return out


def _key_range(i, window: int, bq: int, bk: int, nk: int, skip: bool):
  """The key blocks [lo, hi] query block i can see (all without `skip`)."""
  if not skip:
    return 0, nk - 1
  hi = jnp.minimum(nk - 1, (i * bq + bq - 1) // bk)
  lo = jnp.maximum(0, (i * bq - window + 1) // bk) if window > 0 else 0
  return lo, hi


def _query_range(j, window: int, bq: int, bk: int, nq: int, skip: bool):
  """The query blocks [lo, hi] that can see key block j."""
  if not skip:
    return 0, nq - 1
  lo = (j * bk) // bq
  if window > 0:
    hi = jnp.minimum(nq - 1, (j * bk + bk - 1 + window - 1) // bq)
  else:
    hi = nq - 1
  return lo, hi


def _scores(qi, kj, qpos_i, kpos_j, qseg_i, kseg_j, window, chunk, scale):
  """One block's float32 logits [B, K, G, bq, bk] and what is visible
  ([B, 1, 1, bq, bk], as `attention_mask.attention_mask`)."""
  s = jnp.einsum(
      "BQKGD,BTKD->BKGQT", qi, kj, preferred_element_type=jnp.float32
  )
  s = s * scale
  distance = qpos_i[:, :, None] - kpos_j[:, None, :]
  visible = (distance >= 0) & (qseg_i[:, :, None] == kseg_j[:, None, :])
  if window > 0:
    visible &= distance < window
  if chunk > 0:
    visible &= qpos_i[:, :, None] // chunk == kpos_j[:, None, :] // chunk
  return s, visible[:, None, None]


def _forward(qb, kb, vb, qpos, kpos, qseg, kseg, sinks, static):
  """(out [nq, B, K, G, bq, Dv] float32, lse [nq, B, K, G, bq]); with
  `sinks` [K, G] each row's running maximum starts at its head's sink and
  its sum at 1 (the sink's own term), so the sink is in every row's
  denominator and in its lse."""
  window, chunk, scale, dtype, bq, bk, skip = static
  nk = kb.shape[0]
  _, b, _, kv, g, _ = qb.shape
  dv = vb.shape[-1]

  def query_block(_, xs):
    i, qi, qpos_i, qseg_i = xs

    def key_block(j, carry):
      m, total, acc = carry
      kj, vj = kb[j], vb[j]
      s, visible = _scores(
          qi, kj, qpos_i, kpos[j], qseg_i, kseg[j], window, chunk, scale
      )
      s = jnp.where(visible, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      total = alpha * total + p.sum(-1)
      pv = jnp.einsum(
          "BKGQT,BTKD->BKGQD",
          p.astype(dtype),
          vj.astype(dtype),
          preferred_element_type=jnp.float32,
      )
      return m_new, total, alpha[..., None] * acc + pv

    if sinks is None:
      m0 = jnp.full((b, kv, g, bq), -jnp.inf, jnp.float32)
      total0 = jnp.zeros((b, kv, g, bq), jnp.float32)
    else:
      m0 = jnp.broadcast_to(sinks[None, :, :, None], (b, kv, g, bq))
      total0 = jnp.ones((b, kv, g, bq), jnp.float32)
    init = (m0, total0, jnp.zeros((b, kv, g, bq, dv), jnp.float32))
    lo, hi = _key_range(i, window or chunk, bq, bk, nk, skip)
    m, total, acc = lax.fori_loop(lo, hi + 1, key_block, init)
    empty = total == 0  # a padded query row: it sees no key
    total = jnp.where(empty, 1.0, total)
    out = acc / total[..., None]
    lse = jnp.where(empty, jnp.inf, m + jnp.log(total))
    return None, (out, lse)

  nq = qb.shape[0]
  _, (out, lse) = lax.scan(query_block, None, (jnp.arange(nq), qb, qpos, qseg))
  return out, lse


def _fwd(qb, kb, vb, qpos, kpos, qseg, kseg, sinks, static):
  out, lse = _forward(qb, kb, vb, qpos, kpos, qseg, kseg, sinks, static)
  return out, (qb, kb, vb, qpos, kpos, qseg, kseg, sinks, out, lse)


def _bwd(static, residuals, dout):
  window, chunk, scale, dtype, bq, bk, skip = static
  qb, kb, vb, qpos, kpos, qseg, kseg, sinks, out, lse = residuals
  nq, nk = qb.shape[0], kb.shape[0]
  dout = dout.astype(jnp.float32)  # [nq, B, K, G, bq, Dv]
  delta = jnp.sum(dout * out, axis=-1)  # [nq, B, K, G, bq]

  def key_block(dq, xs):
    j, kj, vj, kpos_j, kseg_j = xs

    def query_block(i, carry):
      dq, dk, dv = carry
      qi = qb[i]
      s, visible = _scores(
          qi, kj, qpos[i], kpos_j, qseg[i], kseg_j, window, chunk, scale
      )
      p = jnp.where(visible, jnp.exp(s - lse[i][..., None]), 0.0)
      g_out = dout[i].astype(dtype)
      dv = dv + jnp.einsum(
          "BKGQT,BKGQD->BTKD",
          p.astype(dtype),
          g_out,
          preferred_element_type=jnp.float32,
      )
      dp = jnp.einsum(
          "BKGQD,BTKD->BKGQT",
          g_out,
          vj.astype(dtype),
          preferred_element_type=jnp.float32,
      )
      ds = (p * (dp - delta[i][..., None]) * scale).astype(qi.dtype)
      dq_i = jnp.einsum(
          "BKGQT,BTKD->BQKGD", ds, kj, preferred_element_type=jnp.float32
      )
      dq = lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, axis=0)
      dk = dk + jnp.einsum(
          "BKGQT,BQKGD->BTKD", ds, qi, preferred_element_type=jnp.float32
      )
      return dq, dk, dv

    init = (
        dq,
        jnp.zeros(kj.shape, jnp.float32),
        jnp.zeros(vj.shape, jnp.float32),
    )
    lo, hi = _query_range(j, window or chunk, bq, bk, nq, skip)
    dq, dk, dv = lax.fori_loop(lo, hi + 1, query_block, init)
    return dq, (dk, dv)

  dq0 = jnp.zeros(qb.shape, jnp.float32)
  dq, (dk, dv) = lax.scan(key_block, dq0, (jnp.arange(nk), kb, vb, kpos, kseg))
  dsinks = None
  if sinks is not None:  # d out / d sink = -p_sink * out, p_sink = e^(sink-lse)
    p_sink = jnp.exp(sinks[None, None, :, :, None] - lse)
    dsinks = -jnp.sum(p_sink * delta, axis=(0, 1, 4)).astype(sinks.dtype)
  return (
      dq.astype(qb.dtype),
      dk.astype(kb.dtype),
      dv.astype(vb.dtype),
      None,
      None,
      None,
      None,
      dsinks,
  )


_attend_blocks.defvjp(_fwd, _bwd)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    positions: jax.Array,
    key_positions: jax.Array,
    window: int,
    scale: float,
    dtype: jnp.dtype,
    segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    self_attention: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    sinks: jax.Array | None = None,
    chunk: int = 0,
) -> jax.Array:
  """Blockwise causal grouped-query attention, the same function as
  `attention.attend`'s einsum: q [B, S, N, Dk], k [B, T, K, Dk], v [B, T, K,
  Dv] -> [B, S, N, Dv]. `self_attention`: skip the key blocks a query block
  cannot see by index (see the module docstring); block sizes that do not
  divide S or T are padded (default `BLOCK_Q`, `BLOCK_K`, read at the
  call); `sinks` <float32>[N]: each query head's sink logit (see
  `_forward`), differentiated too; `chunk` C > 0: chunked attention (a
  query sees its own chunk of C positions: within a document, keys at
  most C - 1 tokens back, which is what the block skipping uses)."""
  b, s, n, dk = q.shape
  t, kv = k.shape[1], k.shape[2]
  if segment_ids is None or key_segment_ids is None:
    segment_ids = jnp.zeros((b, s), jnp.int32)
    key_segment_ids = jnp.zeros((b, t), jnp.int32)
  bq, bk = min(block_q or BLOCK_Q, s), min(block_k or BLOCK_K, t)
  qb = _blocks(q.reshape(b, s, kv, n // kv, dk), bq, 0)
  kb, vb = _blocks(k, bk, 0), _blocks(v, bk, 0)
  qpos = _blocks(positions.astype(jnp.int32), bq, 0)
  kpos = _blocks(key_positions.astype(jnp.int32), bk, 0)
  qseg = _blocks(segment_ids.astype(jnp.int32), bq, _PAD_QUERY)
  kseg = _blocks(key_segment_ids.astype(jnp.int32), bk, _PAD_KEY)
  if sinks is not None:
    sinks = sinks.astype(jnp.float32).reshape(kv, n // kv)
  skip = bool(self_attention)
  static = (int(window), int(chunk), float(scale), jnp.dtype(dtype))
  static += (bq, bk, skip)
  out = _attend_blocks(
      qb, kb, vb, qpos, kpos, qseg, kseg, sinks, static
  )  # [nq, B, K, G, bq, Dv]
  out = jnp.moveaxis(out, 4, 2)  # [nq, B, bq, K, G, Dv]
  out = _unblock(out, s).reshape(b, s, n, v.shape[-1])
  return out.astype(jnp.result_type(dtype, v.dtype))
