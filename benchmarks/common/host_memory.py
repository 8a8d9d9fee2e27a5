"""`LINEN_MOE_REUSE_HOST_MEMORY=1` for a benchmark's own process.

`linen-moe train`, `generate` and `launch` restart themselves, when that
variable asks for it, with glibc malloc tunables under which XLA:CPU reuses
a program's temporary buffer from call to call, and pause `SETTLE_S` after
each step (`linen_moe/_src/run/host_memory.py` says why and what it costs).
Benchmarks import no command-line code, so this does the same for them: the
same variable, the same tunables, the same pause.
"""

from __future__ import annotations

import os
import platform
import sys
import time

OPT_IN = "LINEN_MOE_REUSE_HOST_MEMORY"
ENV = "GLIBC_TUNABLES"
TUNABLES = (
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",
    f"glibc.malloc.trim_threshold={1 << 36}",
)
SETTLE_S = 0.002


def reexec_with_reused_memory() -> None:
  """Restarts this process (same interpreter and arguments) with `TUNABLES`
  added to `GLIBC_TUNABLES` when `OPT_IN` is "1" on glibc and no malloc
  tunable is set yet; else returns. Call it before jax is imported."""
  current = os.environ.get(ENV, "")
  if (
      os.environ.get(OPT_IN) != "1"
      or platform.libc_ver()[0] != "glibc"
      or "glibc.malloc." in current
  ):
    return
  env = dict(os.environ, **{ENV: ":".join(filter(None, (current, *TUNABLES)))})
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def settle() -> None:
  """Waits `SETTLE_S` when this process runs with every one of `TUNABLES`
  (after a step's results are ready), so that XLA:CPU frees the call's
  temporary buffer before the next call asks for one."""
  if set(TUNABLES) <= set(os.environ.get(ENV, "").split(":")):
    time.sleep(SETTLE_S)
