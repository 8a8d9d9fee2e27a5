"""Benchmark tests run from a checkout against the installed package:

  python -m pytest -q benchmarks/tests

They import the scripts as the scripts import each other: `benchmarks/`
(for `common`) and each script's folder first on `sys.path`. The library's
own tests are in tests/ (the wheel's suite); these check the benchmarks'
counting and reporting, never a timing. Slow ones are marked with
`linen_moe.testing.slow`, as in tests/ (out of the default run).
"""

import pathlib
import sys

import pytest

# The mark's reader is the suites' own, not public (tests/conftest.py too).
from linen_moe._src.testing.marks import is_slow  # noqa: TID251

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
for folder in ("device", "layer", "model", "planning", "serving"):
  sys.path.insert(0, str(BENCHMARKS / folder))
sys.path.insert(0, str(BENCHMARKS))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    test = getattr(item, "obj", None)
    if is_slow(test) or is_slow(getattr(item, "cls", None)):
      item.add_marker(pytest.mark.slow)
