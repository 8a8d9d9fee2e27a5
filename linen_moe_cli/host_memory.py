"""Host memory that XLA:CPU programs reuse from one call to the next.

XLA:CPU allocates a program's temporary buffer afresh at every call, with
`posix_memalign` on its executor thread (1.16 GiB for the whole-model
benchmark's train step). glibc serves a request that large from the thread's
own arena with a new `mmap` and unmaps it on free, so every call faults its
whole temporary buffer in again: about 0.3 M page faults and 0.45-0.55 s of
kernel time per train step on a 2-core machine, a quarter of the step's CPU
time. With one arena, no `mmap` and no trimming, the freed buffer stays in
the heap and the next call reuses it: no faults per step once the heap has
grown to its peak (the first few steps), the benchmark's train step 1.45 s
-> 1.18 s.

glibc reads these settings (its malloc tunables) once, when a process starts,
so Python cannot set them for itself: `reexec_with_reused_memory` restarts the
process with them in `GLIBC_TUNABLES`. Only entry points call it (the
`linen-moe` command, the whole-model benchmark), before anything heavy is
imported. The price is memory: the heap keeps its peak size for the life of
the process, which a training or serving process holds anyway.

A user's own script gets the same by starting Python with the variable set:

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
# Set to 1 to run with glibc's own malloc settings.
OPT_OUT = "LINEN_MOE_DEFAULT_MALLOC"


def tuned_environ(
    environ: Mapping[str, str], libc: str | None = None
) -> dict[str, str] | None:
  """The environment to restart a process with, or None to run it as is.

  None on a C library other than glibc (`libc`, default
  `platform.libc_ver()`), when `environ[OPT_OUT]` is "1", and when
  `environ[GLIBC_TUNABLES]` already sets a `glibc.malloc` tunable (the
  user's choice stands). Otherwise a copy of `environ` with `TUNABLES`
  added to any tunables it already sets.
  """
  if libc is None:
    libc = platform.libc_ver()[0]
  if libc != "glibc" or environ.get(OPT_OUT) == "1":
    return None
  current = environ.get(ENV, "")
  if "glibc.malloc." in current:
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
