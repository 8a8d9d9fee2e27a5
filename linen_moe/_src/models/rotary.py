"""Rotary position embeddings.

The "default" RoPE of transformers (Mixtral, Qwen3-MoE): dims i and
i + D/2 of a head rotate together by the angle `position * base ** (-2i/D)`
(the half-split layout, transformers' `rotate_half`), with the angles and
the rotation computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def inverse_frequencies(head_dim: int, base: float) -> jax.Array:
  """<float32>[D/2]: base ** (-2i / D), i < D/2."""
  return 1.0 / base ** (
      jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  )


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary embedding of x [B, S, N, D] at integer positions [B, S]."""
  freq = inverse_frequencies(x.shape[-1], base)  # [D/2]
  angle = positions[..., None].astype(jnp.float32) * freq  # [B, S, D/2]
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, S, N, D/2]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
