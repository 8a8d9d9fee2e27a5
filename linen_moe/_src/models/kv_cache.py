"""The key/value cache of a decoding attention layer.

A layer in decode mode keeps its keys and values (or MLA's latent and
rotary key) in the `cache` collection as `cached_{name}`, per-head entries
[B, S, K, D] stored heads-major [B, K, C, D] (3-d ones [B, C, R] as they
are), and, per slot, the position of the token it holds: `cached_position`
<int32>[B, C], position + 1, 0 for an empty slot. `init` on a [B, max_len]
sample creates them with C = `cache_length(window, max_len)`: `max_len` for
a layer that sees the whole causal past, and for a sliding-window layer
(window W) a ring buffer of min(W, max_len) slots, the token at position p
in slot p mod C, so a long generation's cache is bounded by the window.

Each row has positions of its own (`Decoder` in decode mode gives a
left-padded prompt's padding negative positions): a token at a negative
position is padding, never written and never seen; the mask reads each
slot's stored position, so the slots' order does not matter.

Heads-major because attention contracts each (row, head)'s [C, D] block:
stored [B, C, K, D], XLA:CPU copied the whole cache into that layout at
every decode step (1.74 against 0.19 ms a layer-step at B 8, K 8, D 64,
C 256; 48 against 16 ms at C 4,096).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.config.variables import CACHE

POSITION = "position"


def _heads_major(x: jax.Array) -> jax.Array:
  """[B, C, K, D] <-> [B, K, C, D] (its own inverse); 3-d entries as they
  are."""
  return jnp.swapaxes(x, 1, 2) if x.ndim == 4 else x


def _heads_major_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """`_heads_major`'s result shape."""
  if len(shape) != 4:
    return shape
  b, c, k, d = shape
  return (b, k, c, d)


def cache_length(window: int, max_len: int) -> int:
  """Slots of one layer's cache: `max_len`, or min(W, max_len) for a
  sliding-window layer (W > 0), a ring buffer of the window."""
  return min(window, max_len) if window > 0 else max_len


def write_cache(
    module: nn.Module, new: dict, positions: jax.Array, window: int = 0
):
  """Writes a decoding attention's new entries; returns what it attends to.

  Args:
    module: the attention module (its `cache` collection holds the cache).
    new: {name: [B, S, ...]} the call's new keys and values (or latent),
      stored as `cached_{name}`.
    positions: <int32>[B, S] their positions; negative = padding (not
      written, not seen).
    window: the layer's sliding window W (0: none); W > 0 makes the cache
      a ring buffer of `cache_length(W, max_len)` slots.

  Returns:
    (keys {name: [B, T, ...]}, key positions <int32>[B, T], key validity
    <bool>[B, T], query validity <bool>[B, S]). T is the cache length
    after the write; for a sliding-window layer given S > 1 tokens, the
    cache before the write followed by the S new entries (the ring may
    overwrite keys that the call's first queries still see). At `init` (no
    cache yet) the cache is shaped after `new` and `new` is returned.
  """
  initialized = module.has_variable(CACHE, f"cached_{POSITION}")
  b, s = positions.shape
  slots = cache_length(window, s)
  cached = {
      name: module.variable(
          CACHE,
          f"cached_{name}",
          jnp.zeros,
          _heads_major_shape((b, slots) + x.shape[2:]),
          x.dtype,
      )
      for name, x in new.items()
  }
  stored = module.variable(
      CACHE, f"cached_{POSITION}", jnp.zeros, (b, slots), jnp.int32
  )
  valid = positions >= 0
  if not initialized:
    return new, positions, valid, valid
  c = stored.value.shape[1]
  before = (
      {n: _heads_major(v.value) for n, v in cached.items()},
      stored.value,
  )
  m = min(s, c)  # only the last C of the new tokens stay in a ring
  slot = jnp.where(valid[:, -m:], positions[:, -m:] % c, c)  # c: dropped
  rows = jnp.arange(b)[:, None]
  for name, x in new.items():
    at = cached[name].value.at
    # [rows, :, slot] broadcasts to [B, m, K, D]: the new entries' shape.
    at = at[rows, :, slot] if x.ndim == 4 else at[rows, slot]
    cached[name].value = at.set(x[:, -m:], mode="drop")
  stored.value = stored.value.at[rows, slot].set(
      positions[:, -m:] + 1, mode="drop"
  )
  if window > 0 and s > 1:
    keys = {
        n: jnp.concatenate([before[0][n], x], axis=1) for n, x in new.items()
    }
    held = jnp.concatenate([before[1], jnp.where(valid, positions + 1, 0)], 1)
  else:
    keys = {n: _heads_major(v.value) for n, v in cached.items()}
    held = stored.value
  return keys, held - 1, held > 0, valid
