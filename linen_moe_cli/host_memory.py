"""Host memory that XLA:CPU programs reuse from one call to the next (opt-in).

XLA:CPU allocates a program's temporary buffer afresh at every call, with
`posix_memalign` on its executor thread (1.16 GiB for the whole-model
benchmark's train step). glibc serves a request that large from the thread's
own arena with a new `mmap` and unmaps it on free, so every call faults its
whole temporary buffer in again: about 0.34 M page faults and 0.57-0.61 s
of kernel time per train step on a 2-core machine. With one arena, no
`mmap` and no trimming (`TUNABLES`), the freed buffer stays in the heap and
later calls reuse it: no faults, and that train step takes 1.08-1.18 s
instead of 1.39-1.55 s (`benchmarks/bench_host_memory.py`, medians per
step, one process each).

It is opt-in (`LINEN_MOE_REUSE_HOST_MEMORY=1`) because it costs memory and
compile time. The heap never shrinks and fragments: a buffer freed after the
next call's was allocated leaves a hole the heap grows past, so the same
train step's process peaked at 3.2-4.4 GB RSS over 20 steps and 8.0 GB over
120 (2.9 GB with glibc's defaults either way); that the growth stops is not
shown. And XLA compiles on several threads, which contend for the one
arena: that train step compiles in 5.8-6.2 s instead of 3.5-4.8 s.

glibc reads its tunables once, when a process starts, so Python cannot set
them for itself: `reexec_with_reused_memory` restarts the process with them
in `GLIBC_TUNABLES`. Only entry points call it (`linen-moe train`,
`generate` and `launch`, the whole-model benchmark), before anything heavy
is imported. A script of your own gets the same by starting Python with

  GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:\
glibc.malloc.trim_threshold=68719476736 python train.py
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import platform
import sys

ENV = "GLIBC_TUNABLES"
# One arena (the main one, the only one that can keep a request above 64 MiB
# without mmap), no mmap for large requests, and no returning the heap's top
# to the kernel.
TUNABLES = (
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",
    f"glibc.malloc.trim_threshold={1 << 36}",
)
# Set to 1 to restart with `TUNABLES`.
OPT_IN = "LINEN_MOE_REUSE_HOST_MEMORY"


def tuned_environ(
    environ: Mapping[str, str], libc: str | None = None
) -> dict[str, str] | None:
  """The environment to restart a process with, or None to run it as is.

  A copy of `environ` with `TUNABLES` added to any tunables it already sets
  when `environ[OPT_IN]` is "1" on glibc (`libc`, default
  `platform.libc_ver()`) and `environ[GLIBC_TUNABLES]` sets no
  `glibc.malloc` tunable yet (the user's own choice, or a restart that
  happened, stands); otherwise None.
  """
  if environ.get(OPT_IN) != "1":
    return None
  if libc is None:
    libc = platform.libc_ver()[0]
  current = environ.get(ENV, "")
  if libc != "glibc" or "glibc.malloc." in current:
    return None
  env = dict(environ)
  env[ENV] = ":".join(filter(None, (current, *TUNABLES)))
  return env


def reexec_with_reused_memory() -> None:
  """Restarts this process with `TUNABLES` set when `tuned_environ` says so
  (the same interpreter, flags and arguments, `sys.orig_argv`); else returns.

  Call it first thing in an entry point: the restart repeats whatever ran
  before it.
  """
  env = tuned_environ(os.environ)
  if env is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
