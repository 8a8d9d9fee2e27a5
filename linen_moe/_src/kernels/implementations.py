"""The grouped-matmul implementations by name (no jax: a config checks its
`grouped_matmul` field against them before jax loads)."""

IMPLEMENTATIONS = ("auto", "ragged_dot", "blocked", "kernel")
