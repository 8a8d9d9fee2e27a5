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

from linen_moe import testing

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
for folder in ("device", "layer", "model", "serving"):
  sys.path.insert(0, str(BENCHMARKS / folder))
sys.path.insert(0, str(BENCHMARKS))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    test = getattr(item, "obj", None)
    if testing.is_slow(test) or testing.is_slow(getattr(item, "cls", None)):
      item.add_marker(pytest.mark.slow)
