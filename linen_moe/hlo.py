"""Reading compiled programs: which quantized element types reach their
contractions, which collectives they hold, and the bytes those send.

Reads the text of `jax.jit(f).lower(...).compile().as_text()` (optimised
HLO), so that a claim about a compiled step (an int8 step feeds `s8` to its
expert dots; a sharded step all-gathers once per layer) is checked from the
program itself. `linen-moe matrix` and the tests use it. Imports no jax.

Example usage:

  text = jax.jit(step).lower(*args).compile().as_text()
  assert quantized_types_at_contractions(text) == {"s8"}
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.hlo.reading": (
        "collective_summary",
        "collectives",
        "contractions",
        "quantized_types_at_contractions",
    ),
    "linen_moe._src.hlo.traffic": ("sent_bytes",),
}

_lazy_face(globals(), _EXPORTS)
