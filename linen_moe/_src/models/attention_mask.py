"""Which keys each query sees: the one mask every attention implementation
computes (causal, an optional sliding window or chunk, packed segments).

A leaf of the attention modules: the einsum reference (`attention.py`), the
fused implementations' exact masks (`attention_fused.py`), MLA (`mla.py`)
and the blockwise implementation's block skipping all agree with it.

Shapes: B batch, S queries, T keys.
"""

from __future__ import annotations

import jax


def attention_mask(
    positions: jax.Array,
    key_positions: jax.Array,
    window: int,
    segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    chunk: int = 0,
) -> jax.Array:
  """<bool>[B, S, T]: query at positions [B, S] sees the key at
  key_positions [B, T] iff 0 <= q - k (causal), with a window W > 0
  q - k < W, with a chunk C > 0 q // C == k // C (chunks counted in each
  document's own positions), and with segment ids (<int32>[B, S] and
  [B, T]) both in the same segment (padding, segment 0, sees padding only,
  so no row is empty)."""
  distance = positions[:, :, None] - key_positions[:, None, :]  # [B, S, T]
  visible = distance >= 0
  if window > 0:
    visible &= distance < window
  if chunk > 0:
    same = positions[:, :, None] // chunk == key_positions[:, None, :] // chunk
    visible &= same
  if segment_ids is not None:
    visible &= segment_ids[:, :, None] == key_segment_ids[:, None, :]
  return visible
