"""Drawing the next token: temperature, top-k, top-p (nucleus) and min-p.

The filters find their cut-offs by bisection over the logits' values
rather than by sorting the vocabulary: XLA:CPU sorts [B, V] with a
comparator call per comparison (at batch 8 and V = 4,096 the sort took
more of a decode step than the attention did), while each bisection step
is one compare-and-sum over [B, V], and 32 steps pin any float32 value
exactly. The kept sets are those the sort defines, ties included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Steps of a bisection over the 2**32 keys of `_ordered_keys`.
_KEY_BITS = 32


def _ordered_keys(x: jax.Array) -> jax.Array:
  """float32 [..., V] -> uint32 [..., V] in the floats' order (-inf lowest;
  -0.0 and 0.0 one key): comparing keys is comparing values."""
  x = jnp.where(x == 0, 0.0, x).astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _bisect(keys: jax.Array, goes_up) -> jax.Array:
  """The least key t in [0, 2**32) of each row with `goes_up(t)` [..., 1],
  for a predicate false below some t and true from it on (true at 2**32 -
  1). Returns uint32 [..., 1]."""
  shape = keys.shape[:-1] + (1,)
  lo = jnp.zeros(shape, jnp.uint32)
  hi = jnp.full(shape, 0xFFFFFFFF, jnp.uint32)

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    up = goes_up(mid)
    return jnp.where(up, lo, mid + 1), jnp.where(up, mid, hi)

  lo, _ = jax.lax.fori_loop(0, _KEY_BITS, step, (lo, hi))
  return lo


def _top_k_keep(keys: jax.Array, top_k: jax.Array) -> jax.Array:
  """<bool>[..., V]: the k largest and every value tied with the k-th.

  The k-th largest key is the greatest t with at least k keys >= t: the
  least t with fewer than k keys > t."""
  k = jnp.clip(top_k, 1, keys.shape[-1])

  def fewer_than_k_above(t):
    return jnp.sum(keys > t, axis=-1, keepdims=True) < k

  return keys >= _bisect(keys, fewer_than_k_above)


def _top_p_keep(keys: jax.Array, probs: jax.Array, top_p: jax.Array):
  """<bool>[..., V]: the nucleus, the tokens whose more likely tokens
  (strictly) hold less than `top_p` of the mass, i.e. the most likely
  tokens until their mass reaches p, ties with the last one kept.

  That set is every key >= the least t whose keys above hold < p; the
  largest key always counts as such a t (nothing is above it), so a p that
  rounds to 0 in float32 keeps the most likely token."""

  def mass_above_below_p(t):
    above = jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1, keepdims=True)
    return (above < top_p) | (above == 0.0)

  return keys >= _bisect(keys, mass_above_below_p)


def filter_logits(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> jax.Array:
  """The logits a draw samples from, in float32: -inf outside the kept set.

  In order, as transformers' samplers: logits / temperature; top-k keeps
  the k largest (k = 0: all; ties with the k-th are kept); top-p keeps the
  most likely tokens, renormalized, until their mass reaches p (the
  smallest such set, at least one token, ties with the last kept; p = 1:
  all); min-p keeps the tokens whose renormalized probability is at least
  min_p times the largest. A filter that keeps everything is not computed.

  Args:
    logits: [..., V].
    temperature: > 0 (scalar).
    top_k: >= 0 (scalar, int).
    top_p: in (0, 1] (scalar).
    min_p: in [0, 1] (scalar).

  Returns:
    <float32>[..., V], the scaled logits of the kept tokens, -inf elsewhere.
  """
  x = logits.astype(jnp.float32) / temperature
  keys = _ordered_keys(x)
  x = jax.lax.cond(
      top_k > 0,
      lambda x: jnp.where(_top_k_keep(keys, top_k), x, -jnp.inf),
      lambda x: x,
      x,
  )
  x = jax.lax.cond(
      top_p < 1.0,
      lambda x: jnp.where(
          _top_p_keep(keys, jax.nn.softmax(x, axis=-1), top_p), x, -jnp.inf
      ),
      lambda x: x,
      x,
  )
  probs = jax.nn.softmax(x, axis=-1)
  floor = min_p * jnp.max(probs, axis=-1, keepdims=True)
  return jnp.where(probs < floor, -jnp.inf, x)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> jax.Array:
  """One token per row: <int32>[B] from logits [B, V] and keys [B].

  Temperature 0 is greedy (argmax; the filters are not computed); above,
  a draw with each row's own key from `filter_logits`.
  """

  def greedy(_):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(_):
    kept = filter_logits(logits, temperature, top_k, top_p, min_p)
    return jax.vmap(jax.random.categorical)(keys, kept).astype(jnp.int32)

  return jax.lax.cond(temperature == 0, greedy, draw, None)
