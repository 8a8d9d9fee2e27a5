"""The NNX adapter: the one place Linen meets NNX."""
