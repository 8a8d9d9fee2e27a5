"""Test-session setup, applied before any test module imports jax."""

import os

# The suite is dominated by XLA compile time of many tiny programs, not by
# their run time: a lower LLVM optimisation level halves compile time without
# changing what XLA computes. Benchmarks never set this.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  ).strip()
