"""How this project's processes compile: a persistent cache, a fast mode.

The command line (`linen-moe matrix`) and the test suite share this policy,
so that programs one of them compiled load from disk in the other. Imports
no jax: both functions are meant to run before jax is imported, and set
environment variables that child processes (test workers, matrix workers)
inherit.
"""

from __future__ import annotations

import os
import sys
import tempfile

# Compiled programs persist here (unless JAX_COMPILATION_CACHE_DIR says
# otherwise), shared by the test session and `linen-moe matrix` on one
# machine: the matrix cells the tests already compiled load instead.
COMPILATION_CACHE_DIR = os.path.join(
    tempfile.gettempdir(), "linen_moe_jax_cache"
)
# Only programs that took longer than this to compile are written.
CACHE_MIN_COMPILE_TIME_S = 1.0


def use_compilation_cache() -> None:
  """Turns on JAX's persistent compilation cache for programs that took
  over `CACHE_MIN_COMPILE_TIME_S` to compile, in `COMPILATION_CACHE_DIR`
  unless `JAX_COMPILATION_CACHE_DIR` names another directory.

  Sets the environment (inherited by child processes); when jax is already
  imported (it reads these variables at import) it updates jax's config too.
  """
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE_DIR)
  os.environ.setdefault(
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
      str(CACHE_MIN_COMPILE_TIME_S),
  )
  if "jax" in sys.modules:
    jax = sys.modules["jax"]
    jax.config.update(
        "jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"]
    )
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )


def use_fast_compile() -> None:
  """Compiles at XLA's backend optimisation level 0: about half the compile
  time of many small programs, the same numerics, slower steps.

  Must run before the first computation (XLA reads `XLA_FLAGS` when its
  backend starts); a level already set in `XLA_FLAGS` is kept.
  """
  add_xla_flag("xla_backend_optimization_level", "0")


def add_xla_flag(name: str, value: str) -> None:
  """Appends `--name=value` to this process's `XLA_FLAGS` (inherited by
  child processes) unless `XLA_FLAGS` already sets `name`. Takes effect
  only before XLA's backend starts."""
  flags = os.environ.get("XLA_FLAGS", "")
  if name not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()
