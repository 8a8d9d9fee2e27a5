"""Grouped-matmul implementations and kernels, int8 grouped matmul, ragged collectives."""
