"""Test-session setup, applied before any test runs a computation."""

from hypothesis import Phase
from hypothesis import settings

from linen_moe_cli.main import use_compilation_cache
from linen_moe_cli.main import use_fast_compile

# The suite is dominated by XLA compile time of many tiny programs, not by
# their run time: a lower LLVM optimisation level halves compile time without
# changing what XLA computes. Benchmarks never set this.
use_fast_compile()
# Shared with `linen-moe matrix` on this machine (see use_compilation_cache).
use_compilation_cache()

# Property tests (tests/test_properties.py): every new config or shape is a
# new compile, so the default run draws a few examples, the same ones every
# run, and reports a failing one as drawn (shrinking it would compile dozens
# of programs); `--hypothesis-profile=slow` explores many more, randomly.
settings.register_profile(
    "ci",
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
)
settings.register_profile("slow", max_examples=200, deadline=None)
settings.load_profile("ci")
