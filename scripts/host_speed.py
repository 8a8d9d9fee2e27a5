"""How fast this machine compiles now: the yardstick of the suite's times.

The test suite's cold time is compile time, and this host's speed moves by
half within an hour (the same default run took 9:03 and 12:30 on one
morning). This script compiles a fixed set of 20 small programs (a tanh
chain and its gradient, 20 to 39 links) at the suite's compile settings,
with no cache, and prints the seconds they took; a default run's cold time
measured beside it is comparable across hours as a multiple of it (about
27x on 2 cores: 543 s at 20.3 s, 673 s at 25.0 s).

  .venv/bin/python scripts/host_speed.py      # before and after a run
"""

import os
import time

os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
os.environ["XLA_FLAGS"] = (  # as tests/conftest.py
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
)

# pylint: disable=g-import-not-at-top
from linen_moe.testing import use_fast_compile

use_fast_compile()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

LINKS = range(20, 40)


def _chain(x, w, links: int):
  for i in range(links):
    x = jnp.tanh(x @ w) + jnp.sin(x) * i
  return (x**2).sum()


def compile_seconds() -> float:
  """Seconds to compile and run the gradients of the 20 chains ([64, 64])."""
  x = jnp.ones((64, 64))
  total = 0.0
  for links in LINKS:
    grad = jax.jit(jax.grad(lambda x, w, n=links: _chain(x, w, n)))
    start = time.perf_counter()
    grad(x, x).block_until_ready()
    total += time.perf_counter() - start
  return total


if __name__ == "__main__":
  print(f"compile {compile_seconds():.2f} s ({time.strftime('%H:%M:%S')})")
