"""The MoE layer: routing, experts, the dense and sparse paths, token permutation, expert parallelism, variable collections."""
