"""Cross-entropy over a large vocabulary without the [B, S, V] logits.

The decoder's output head and the loss are one computation here: the final
hidden state [B, S, M] meets the head [M, V] a block of Vc vocabulary
entries at a time, forward and backward (`jax.custom_vjp` over a
`lax.scan`), so at any moment one block's float32 logits [B, S, Vc] exist,
not all of them. The forward keeps a running log-sum-exp per position
(online softmax) and keeps only it [B, S]; the backward recomputes each
block's logits, and writes that block's columns of the head's gradient
once (one matmul over every position, as the full computation does), so
nothing of size [M, V] is held beyond the gradient itself. Blocks of the
vocabulary rather than of the positions: the head's gradient would
otherwise be a float32 [M, V] sum over position chunks (1.2 GB for
Qwen3-30B-A3B's head), and the head a float32 copy in every chunk.

The numbers are those of `step.cross_entropy` of the decoder's logits (the
same float32 products and sums, softcap, log-sum-exp and weights) to float
rounding.

Shapes: B batch, S sequence, M emb_dim, V vocab, Vc vocabulary per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# A block's float32 logits hold at most about this many bytes.
CHUNK_BYTES = 1 << 27  # 128 MiB


def vocab_chunk_size(batch: int, seq: int, vocab: int) -> int:
  """Vc: vocabulary entries per block, so that [B, S, Vc] float32 fits
  `CHUNK_BYTES`.

  Args:
    batch: B.
    seq: S.
    vocab: V.

  Returns:
    Vc in [1, V].
  """
  return max(1, min(vocab, CHUNK_BYTES // max(4 * batch * seq, 1)))


def _blocks(vocab: int, size: int):
  """(starts, firsts) <int32>[n]: block i reads columns [starts[i],
  starts[i] + size) and counts those >= firsts[i] (the last block is moved
  back to end at V; the columns it shares with the one before count
  there)."""
  n = -(-vocab // size)
  firsts = jnp.arange(n, dtype=jnp.int32) * size
  return jnp.minimum(firsts, vocab - size), firsts


def _logits(hidden, kernel, start, size, softcap):
  """hidden [B, S, M] @ kernel[:, start : start + size] -> float32 [B, S,
  size], soft-capped."""
  block = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=1)
  z = jnp.einsum(
      "BSM,MV->BSV", hidden, block, preferred_element_type=jnp.float32
  )
  if softcap:
    z = jnp.tanh(z / softcap) * softcap
  return z


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _weighted_nll(hidden, kernel, targets, weights, size, softcap):
  nll, _ = _fwd(hidden, kernel, targets, weights, size, softcap)
  return nll


def _fwd(hidden, kernel, targets, weights, size, softcap):
  b, s = targets.shape
  starts, firsts = _blocks(kernel.shape[1], size)

  def body(carry, xs):
    top, total, picked = carry  # [B, S] each
    start, first = xs
    z = _logits(hidden, kernel, start, size, softcap)  # [B, S, Vc]
    cols = start + jnp.arange(size, dtype=jnp.int32)
    new = cols >= first  # [Vc]
    z = jnp.where(new, z, -jnp.inf)
    top_new = jnp.maximum(top, jnp.max(z, axis=-1))
    total = total * jnp.exp(top - top_new) + jnp.sum(
        jnp.exp(z - top_new[..., None]), axis=-1
    )
    hit = (cols == targets[..., None]) & new
    picked += jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    return (top_new, total, picked), None

  zeros = jnp.zeros((b, s), jnp.float32)
  init = (jnp.full((b, s), -jnp.inf, jnp.float32), zeros, zeros)
  (top, total, picked), _ = jax.lax.scan(body, init, (starts, firsts))
  lse = top + jnp.log(total)
  return jnp.sum(weights * (lse - picked)), (
      hidden,
      kernel,
      targets,
      weights,
      lse,
  )


def _bwd(size, softcap, residuals, g):
  hidden, kernel, targets, weights, lse = residuals
  starts, firsts = _blocks(kernel.shape[1], size)
  scale = (g * weights)[..., None]  # [B, S, 1]

  def body(carry, xs):
    dhidden, dkernel = carry
    start, first = xs
    z = _logits(hidden, kernel, start, size, softcap)  # recomputed
    cols = start + jnp.arange(size, dtype=jnp.int32)
    new = cols >= first
    dz = jnp.exp(z - lse[..., None]) - (cols == targets[..., None])
    dz = jnp.where(new, dz * scale, 0.0)
    if softcap:  # d(c tanh(u / c))/du = 1 - tanh^2 = 1 - (z / c)^2
      dz = dz * (1.0 - jnp.square(z / softcap))
    block = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=1)
    dhidden += jnp.einsum(
        "BSV,MV->BSM", dz, block, preferred_element_type=jnp.float32
    )
    dblock = jnp.einsum(
        "BSM,BSV->MV", hidden, dz, preferred_element_type=jnp.float32
    ).astype(dkernel.dtype)
    old = jax.lax.dynamic_slice_in_dim(dkernel, start, size, axis=1)
    dblock = jnp.where(new, dblock, old)
    dkernel = jax.lax.dynamic_update_slice_in_dim(dkernel, dblock, start, 1)
    return (dhidden, dkernel), None

  init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros_like(kernel))
  (dhidden, dkernel), _ = jax.lax.scan(body, init, (starts, firsts))
  return dhidden.astype(hidden.dtype), dkernel, None, None


_weighted_nll.defvjp(_fwd, _bwd)


def chunked_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    tokens: jax.Array,
    weights: jax.Array | None = None,
    *,
    softcap: float = 0.0,
    chunk_size: int | None = None,
) -> jax.Array:
  """`cross_entropy(hidden @ kernel, tokens, weights)`, block by block of
  the vocabulary.

  Position s predicts token s + 1, over the B * (S - 1) positions that have
  a next token; with `weights` the mean of the weighted terms, as
  `linen_moe.training.cross_entropy`.

  Args:
    hidden: [B, S, M] the decoder's final normalized hidden state (any
      float dtype; its gradient comes back in it).
    kernel: [M, V] the output head (`output_kernel`: the tied embedding's
      transpose or the head's kernel).
    tokens: <int>[B, S] token ids; `tokens[:, 1:]` are the targets.
    weights: optional <float32>[B, S - 1] weight of each target
      (`loss_weights`); None weighs every target 1.
    softcap: the final logit softcap c (0: none): logits c tanh(z / c).
    chunk_size: vocabulary entries per block; None: `vocab_chunk_size`
      (about 128 MiB of float32 logits a block).

  Returns:
    The float32 scalar `sum(weights * nll) / (B * (S - 1))`, in nats.

  Raises:
    ValueError: for fewer than 2 tokens per row, or a `chunk_size` < 1.
  """
  b, s = tokens.shape
  if s < 2:
    raise ValueError(
        "chunked_cross_entropy needs at least 2 tokens per row; got tokens "
        f"of shape {tokens.shape}."
    )
  if chunk_size is None:
    chunk_size = vocab_chunk_size(b, s, kernel.shape[-1])
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
    raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1.")
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1.")
  targets = jnp.concatenate(
      [tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1
  )
  if weights is None:
    has_next = jnp.arange(s) < s - 1
    weights = jnp.broadcast_to(has_next / (b * (s - 1)), (b, s))
  else:
    weights = jnp.concatenate(
        [weights / (b * (s - 1)), jnp.zeros((b, 1), weights.dtype)], axis=1
    )
  return _weighted_nll(
      hidden,
      kernel,
      targets,
      weights.astype(jnp.float32),
      min(chunk_size, kernel.shape[-1]),
      float(softcap or 0.0),
  )
