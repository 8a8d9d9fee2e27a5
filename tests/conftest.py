"""Test-session setup, applied before any test runs a computation."""

import os

from hypothesis import Phase
from hypothesis import settings

import linen_moe
from linen_moe.testing import use_compilation_cache
from linen_moe.testing import use_fast_compile

_SOURCE_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# CI runs the suite against the installed wheel, from a copy of tests/: a
# module the wheel lacks must fail the run, never be found in a checkout.
if os.environ.get("LINEN_MOE_REQUIRE_INSTALLED") and "site-packages" not in (
    linen_moe.__file__
):
  raise RuntimeError(
      "LINEN_MOE_REQUIRE_INSTALLED is set, but linen_moe was imported from"
      f" {linen_moe.__file__}, not from an installed package"
  )


def pytest_report_header(config):
  del config
  where = os.path.dirname(linen_moe.__file__)
  kind = "source tree" if where.startswith(_SOURCE_TREE) else "installed"
  return f"linen_moe {linen_moe.__version__} from {where} ({kind})"


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
