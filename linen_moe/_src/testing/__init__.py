"""What tests and benchmarks share: helpers, the slow mark, the compile policy."""
