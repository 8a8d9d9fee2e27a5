"""The layer's variable collections and RNG streams, and initialising them.

Three kinds of state, each in its own collection: `params` (the
optimizer's), `OVERWRITE_WITH_GRADIENT` (fp8 scales and amax histories:
differentiated, and the "gradient" written back as the new value) and
`UPDATED_BY_RULE` (state a rule moves after each step, the routed bias);
`STATE_COLLECTIONS` lists the non-parameter ones, and `CACHE` is the
decoders' KV cache. `RNG_STREAMS` are the streams the layer draws from at
apply time (`rng_dict` makes one key for each).

`compiled_init` runs a Linen module's `init` as one compiled program (the
same numbers as eager, seconds instead of thousands of tiny compilations);
`jit_once` compiles any one-shot initialiser that way.
"""

from linen_moe._src.config.variables import AQT_RNG_STREAM
from linen_moe._src.config.variables import CACHE
from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.config.variables import RNG_STREAMS
from linen_moe._src.config.variables import ROUTER_JITTER_RNG_STREAM
from linen_moe._src.config.variables import STATE_COLLECTIONS
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.config.variables import rng_dict
from linen_moe._src.layer.jit_init import compiled_init
from linen_moe._src.layer.jit_init import jit_once

__all__ = [
    "AQT_RNG_STREAM",
    "CACHE",
    "OVERWRITE_WITH_GRADIENT",
    "RNG_STREAMS",
    "ROUTER_JITTER_RNG_STREAM",
    "STATE_COLLECTIONS",
    "UPDATED_BY_RULE",
    "compiled_init",
    "jit_once",
    "rng_dict",
]
