"""Page faults of a compiled program's calls, in a process restarted (or not)
by `linen_moe.training.reuse_host_memory`.

  python -m tests.cli_host_memory_worker tuned|default

prints one JSON line: the process's GLIBC_TUNABLES, the program's
temporary buffer in 4 KiB pages, and the minor page faults of each of
`CALLS` calls.
"""

import json
import os
import resource
import sys

from linen_moe import training
from linen_moe._src.run import host_memory

if sys.argv[1] == "tuned":
  os.environ[host_memory.OPT_IN] = "1"
training.reuse_host_memory()

import jax  # noqa: E402  (after the restart: imported once)
import jax.numpy as jnp  # noqa: E402

CALLS = 24


@jax.jit
def _program(x):
  y = x @ x.T  # [8192, 8192] float32: a 256 MiB temporary buffer
  return y @ x


def main() -> None:
  x = jnp.ones((8192, 16), jnp.float32)
  compiled = _program.lower(x).compile()
  faults = []
  for _ in range(CALLS):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(compiled(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  print(
      json.dumps({
          "tunables": os.environ.get(host_memory.ENV),
          "temp_pages": compiled.memory_analysis().temp_size_in_bytes // 4096,
          "faults": faults,
      })
  )


if __name__ == "__main__":
  main()
