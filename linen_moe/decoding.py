"""Batched greedy decoding of the reference decoder with its KV cache."""

from linen_moe._src.models.decoding import decode_step
from linen_moe._src.models.decoding import generate_program
from linen_moe._src.models.decoding import greedy_generate
from linen_moe._src.models.decoding import init_cache
from linen_moe._src.models.decoding import prefill

__all__ = [
    "decode_step",
    "generate_program",
    "greedy_generate",
    "init_cache",
    "prefill",
]
