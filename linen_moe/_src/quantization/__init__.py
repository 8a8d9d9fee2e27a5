"""Quantization: the modes table, the quantized contraction modules, stored serving weights and their conversion."""
