"""Decoding of the reference decoder with its KV cache: a model loaded
from a training run or a Hugging Face folder with its tokenizer and stop
ids (`load_model`), greedy and sampled generation for prompts of any
lengths (`generate`, `generate_stream`; how a token is drawn is one
`Sampling`), stop ids, and the cache and its steps (`init_cache`,
`prefill`, `decode_step`)."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.sampling": ("Sampling",),
    "linen_moe._src.models.decoding": (
        "cache_bytes_per_token",
        "decode_step",
        "generate_program",
        "greedy_generate",
        "init_cache",
        "prefill",
    ),
    "linen_moe._src.models.generation": (
        "GenerationResult",
        "generate",
        "generate_stream",
    ),
    "linen_moe._src.run.loading": ("load_model",),
}

_lazy_face(globals(), _EXPORTS)
