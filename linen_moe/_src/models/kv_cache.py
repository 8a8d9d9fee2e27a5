"""The key/value cache of a decoding attention layer.

A layer in decode mode keeps its keys and values (or MLA's latent and
rotary key) in the `cache` collection as `cached_{name}` [B, max_len, ...],
created by `init` on a [B, max_len] sample, and writes each call's new
entries at their positions.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.layer.variables import CACHE


def write_cache(module: nn.Module, new: dict, positions: jax.Array):
  """The cache of a decoding attention: ({name: whole cache [B, max_len,
  ...]}, key positions [B, max_len]) after writing each `new` [B, S, ...]
  at positions[0, 0] .. + S - 1 (every row at the same positions) into the
  `cache` variable `cached_{name}`. At init (no cache yet) the cache is
  shaped after `new` and `new` is returned as it is."""
  initialized = module.has_variable(CACHE, f"cached_{next(iter(new))}")
  cached = {
      name: module.variable(
          CACHE, f"cached_{name}", jnp.zeros, x.shape, x.dtype
      )
      for name, x in new.items()
  }
  if not initialized:
    return new, positions
  out = {}
  for name, x in new.items():
    start = (0, positions[0, 0]) + (0,) * (x.ndim - 2)
    cached[name].value = jax.lax.dynamic_update_slice(
        cached[name].value, x, start
    )
    out[name] = cached[name].value
  b, max_len = positions.shape[0], out[name].shape[1]
  return out, jnp.broadcast_to(jnp.arange(max_len), (b, max_len))
