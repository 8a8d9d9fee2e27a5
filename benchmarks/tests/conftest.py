"""Benchmark tests run from a checkout against the installed package:

  python -m pytest -q benchmarks/tests

They import the scripts as the scripts import each other: `benchmarks/`
(for `common`) and each script's folder first on `sys.path`. The library's
own tests are in tests/ (the wheel's suite); these check the benchmarks'
counting and reporting, never a timing.
"""

import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
for folder in (BENCHMARKS, *(BENCHMARKS / f for f in ("layer", "model"))):
  sys.path.insert(0, str(folder))
sys.path.insert(0, str(BENCHMARKS / "serving"))
