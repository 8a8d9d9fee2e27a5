"""Decoding of the reference decoder with its KV cache: greedy and sampled
generation for prompts of any lengths, stop ids, and the cache itself."""

from linen_moe._src.models.decoding import GenerationResult
from linen_moe._src.models.decoding import cache_bytes_per_token
from linen_moe._src.models.decoding import decode_step
from linen_moe._src.models.decoding import generate
from linen_moe._src.models.decoding import generate_program
from linen_moe._src.models.decoding import generate_stream
from linen_moe._src.models.decoding import greedy_generate
from linen_moe._src.models.decoding import init_cache
from linen_moe._src.models.decoding import prefill
from linen_moe._src.models.sampling import filter_logits

__all__ = [
    "GenerationResult",
    "cache_bytes_per_token",
    "decode_step",
    "filter_logits",
    "generate",
    "generate_program",
    "generate_stream",
    "greedy_generate",
    "init_cache",
    "prefill",
]
