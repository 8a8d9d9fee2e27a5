"""The layer's variable collections and RNG streams, and initialising them.

Three kinds of state, each in its own collection: `params` (the
optimizer's), `OVERWRITE_WITH_GRADIENT` (fp8 scales and amax histories:
differentiated, and the "gradient" written back as the new value) and
`UPDATED_BY_RULE` (state a rule moves after each step, the routed bias);
`STATE_COLLECTIONS` lists the non-parameter ones, and `CACHE` is the
decoders' KV cache. `RNG_STREAMS` are the streams the layer draws from at
apply time (`rng_dict` makes one key for each).

Compiled initialisation (`compiled_init`, `jit_once`) is in
`linen_moe.frontend`.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.variables": (
        "CACHE",
        "OVERWRITE_WITH_GRADIENT",
        "RNG_STREAMS",
        "STATE_COLLECTIONS",
        "UPDATED_BY_RULE",
        "rng_dict",
    ),
}

_lazy_face(globals(), _EXPORTS)
