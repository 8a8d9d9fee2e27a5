"""Test-session setup, applied before any test runs a computation."""

from linen_moe_cli.main import use_compilation_cache
from linen_moe_cli.main import use_fast_compile

# The suite is dominated by XLA compile time of many tiny programs, not by
# their run time: a lower LLVM optimisation level halves compile time without
# changing what XLA computes. Benchmarks never set this.
use_fast_compile()
# Shared with `linen-moe matrix` on this machine (see use_compilation_cache).
use_compilation_cache()
