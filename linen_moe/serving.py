"""Quantized serving: expert kernels converted once to their storage type."""

from linen_moe._src.quantization.serving import expert_weight_bytes
from linen_moe._src.quantization.serving import quantize_weights

__all__ = [
    "expert_weight_bytes",
    "quantize_weights",
]
