"""Decoding of the reference decoder with its KV cache: greedy and sampled
generation for prompts of any lengths, stop ids, and the cache itself."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.models.decoding": (
        "GenerationResult",
        "cache_bytes_per_token",
        "decode_step",
        "generate",
        "generate_program",
        "generate_stream",
        "greedy_generate",
        "init_cache",
        "prefill",
    ),
}

_lazy_face(globals(), _EXPORTS)
