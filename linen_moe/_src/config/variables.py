"""The variable collections and RNG streams the layer uses: one list of each.

Three kinds of state, each in its own collection:

  params                    the optimizer's parameters.
  _overwrite_with_gradient  fp8 scales and amax histories: differentiated, and
                            the "gradient" is written back as the new value.
  updated_by_rule           state a rule moves after each optimizer step (the
                            selection-only `routed_bias`): neither
                            differentiated nor optimised; replicated.

plus, while decoding, the KV cache (`CACHE`).

Anything that scans, stacks, shards or saves the layer's variables reads
`STATE_COLLECTIONS` (every collection but `params`) and `RNG_STREAMS` from
here, so a new kind of state is registered in one place.
"""

from __future__ import annotations

from flax.linen import fp8_ops
import jax

PARAMS = "params"
OVERWRITE_WITH_GRADIENT = fp8_ops.OVERWRITE_WITH_GRADIENT

UPDATED_BY_RULE = "updated_by_rule"

# Non-parameter collections the layer may keep, in a fixed order.
STATE_COLLECTIONS = (OVERWRITE_WITH_GRADIENT, UPDATED_BY_RULE)

# The reference decoder's KV cache in decode mode (`linen_moe.decoding`):
# stacked per layer like the state above, but neither trained nor saved.
CACHE = "cache"

# AQT int8 draws its stochastic rounding of the input gradient from this
# stream whenever gradients are taken.
AQT_RNG_STREAM = "params"

# Router jitter draws its multiplicative noise from this stream; without it
# (e.g. at evaluation) the router is deterministic.
ROUTER_JITTER_RNG_STREAM = "router_jitter"

# Flax RNG streams the layer draws from at apply time; scanned layers split
# each, so every layer draws its own.
RNG_STREAMS = (AQT_RNG_STREAM, ROUTER_JITTER_RNG_STREAM)


def rng_dict(rng: jax.Array) -> dict[str, jax.Array]:
  """One key per stream of `RNG_STREAMS`, for `apply(..., rngs=...)`.

  Args:
    rng: a PRNG key, split into one key per stream.

  Returns:
    A dict from each stream name of `RNG_STREAMS` to its own key.
  """
  keys = jax.random.split(rng, len(RNG_STREAMS))
  return dict(zip(RNG_STREAMS, keys, strict=True))
