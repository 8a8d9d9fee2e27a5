"""Test-session setup, applied before any test runs a computation.

Slow tests: mark a test class or method with `linen_moe.testing.slow`
(above or below an absltest `@parameterized...` decorator, or on a
`hypothesis` test); `pytest_collection_modifyitems` below gives each case the
"slow" marker, which the default run (`-m 'not slow'`, pyproject.toml)
leaves out and `pytest -m slow` runs. A bare `pytest.mark.slow` on a
parameterized method is silently lost above the decorator, hence this one
way for every test. Heavy tests (`linen_moe._src.testing.marks.heavy`: the
only check of a claim, too long for the default run) get the "heavy"
marker the same way: out of the default run, in `pytest -m heavy`, which
`.ci/run` runs after it. See tests/README.md.
"""

import gc
import os
import tempfile

from hypothesis import Phase
from hypothesis import settings
import pytest

import linen_moe
from linen_moe._src.testing.compile_options import add_xla_flag
from linen_moe._src.testing.marks import is_heavy
from linen_moe._src.testing.marks import is_slow
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


# The files that take longest (cold, 2 cores: `--durations=0`, summed per
# file), which a parallel run starts first; a stale list only schedules
# less well.
_LONGEST_FILES = (
    "test_sharding.py",
    "test_remat.py",
    "test_nnx_adapter.py",
    "test_lora.py",
    "test_decoder.py",
    "test_decoding.py",
    "test_hf.py",
    "test_cli_launch.py",
    "test_serving.py",
    "test_routed_bias.py",
)


def pytest_configure(config):
  # `-n N` hands each worker whole files (xdist's "loadfile"; another
  # `--dist` than the default "load" is kept): the programs a file's tests
  # share (module-level caches of configs, variables, compiled steps) are
  # traced and compiled once, not in every worker. 6 % less wall time cold
  # (10:45 -> 10:06, the default run on 2 cores). The longest files go
  # first, so that no long file runs alone at the end.
  if getattr(config.option, "dist", "no") == "load":
    config.option.dist = "loadfile"
    config.option.loadscopereorder = False


def _file_rank(item) -> int:
  name = os.path.basename(str(item.path))
  if name in _LONGEST_FILES:
    return _LONGEST_FILES.index(name)
  return len(_LONGEST_FILES)


# (marker, whether a test has it, the way to give it)
_MARKS = (
    ("slow", is_slow, "linen_moe.testing.slow"),
    ("heavy", is_heavy, "linen_moe._src.testing.marks.heavy"),
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  del config
  items.sort(key=_file_rank)  # stable: each file's tests keep their order
  for item in items:
    test = getattr(item, "obj", None)
    cls = getattr(item, "cls", None)
    for mark, is_marked, how in _MARKS:
      if is_marked(test) or is_marked(cls):
        item.add_marker(getattr(pytest.mark, mark))
      elif item.get_closest_marker(mark) is not None:
        raise pytest.UsageError(
            f"{item.nodeid}: mark {mark} tests with {how}, not"
            f" pytest.mark.{mark} (lost above @parameterized); see"
            " tests/README.md"
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
# Two pytest processes share two cores: Eigen's thread pool speeds none of
# the suite's tiny programs, and makes the processes (and their 8-device
# workers, which inherit XLA_FLAGS) fight for the cores: 9 % less wall time
# measured on test_sharding + test_serving (83 s -> 75 s, -n 2).
add_xla_flag("xla_cpu_multi_thread_eigen", "false")
# Shared with `linen-moe matrix` on this machine (see use_compilation_cache).
# Every program is written, not only those over a second: at level 0 most of
# the suite's programs compile in less, and a warm run should load them all.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
use_compilation_cache()

# Tracing allocates millions of short-lived objects beside a large heap that
# lives for the session (modules, jaxprs, compiled programs); CPython's
# default thresholds collect and re-scan that heap about 2,000 times a file
# pair: 2.9 s of 77 s in test_decoding + test_serving (timed with
# `gc.callbacks`), 0.4 s with the imports frozen and rarer collections.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 50, 1_000)

# Property tests (tests/layer/test_properties.py): every new config or shape
# is a new compile, so the default run draws a few examples, the same ones
# every run, and reports a failing one as drawn (shrinking it would compile dozens
# of programs); `--hypothesis-profile=slow` explores many more, randomly.
# `linen-moe train` without --checkpoint-dir makes runs/<config>-<time>
# under $LINEN_MOE_RUNS_DIR: in a directory of this session, never the
# checkout's (a worker process inherits it).
os.environ.setdefault(
    "LINEN_MOE_RUNS_DIR", tempfile.mkdtemp(prefix="linen_moe_runs-")
)

settings.register_profile(
    "ci",
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
)
# The slow set runs the property tests under this profile too
# (`test_properties.SlowProfileTest`).
settings.register_profile("slow", max_examples=200, deadline=None)
settings.load_profile("ci")
