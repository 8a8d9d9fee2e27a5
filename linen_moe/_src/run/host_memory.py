"""Host memory that XLA:CPU programs reuse from one call to the next (opt-in).

XLA:CPU allocates a program's temporary buffer afresh at every call, with
`posix_memalign` on its executor thread (1.16 GiB for the whole-model
benchmark's train step). glibc serves a request that large from the thread's
own arena with a new `mmap` and unmaps it on free, so every call faults its
whole temporary buffer in again: about 0.34 M page faults and 0.57-0.61 s
of kernel time per train step on a 2-core machine. With one arena, no
`mmap` and no trimming (`TUNABLES`), the freed buffer stays in the heap and
later calls reuse it: no faults, and that train step takes 0.88-1.18 s
instead of 1.24-1.55 s (`benchmarks/model/bench_host_memory.py`, medians
per step, one process each).

The heap never shrinks, and it grows past any buffer still allocated when
the next is asked for. XLA:CPU frees a call's temporary buffer on its
executor thread a moment after the call's results are ready, so a loop that
calls the next step at once asks for the new buffer first: the old one's
space is then taken by smaller allocations, and the heap grows by another
buffer. Back to back, the same train step's process peaked at 6.8 GB RSS
within 30 steps and 8.0 GB over 120; with `settle`, a pause of `SETTLE_S` after each step,
at 3.15-3.16 GB over 30 and over 120 steps (2.9 GB with glibc's defaults).
`linen-moe train` settles after every step; a loop of your own should too
(`time.sleep(0.002)` once the step's results are read).

It stays opt-in (`LINEN_MOE_REUSE_HOST_MEMORY=1`): the heap never gives
memory back to the system, its flatness rests on a pause that a loaded
machine could outlast, and XLA compiles on several threads, which contend
for the one arena (that train step compiles in 4.5-6.2 s instead of
2.8-4.8 s).

glibc reads its tunables once, when a process starts, so Python cannot set
them for itself: `reuse_host_memory` (`linen_moe.training.reuse_host_memory`)
restarts the process with them in `GLIBC_TUNABLES` when
`LINEN_MOE_REUSE_HOST_MEMORY=1` asks for it. Entry points call it first
thing, before anything heavy is imported (`linen-moe train`, `generate` and
`launch`; a script of your own likewise). Starting Python with

  GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:\
glibc.malloc.trim_threshold=68719476736 python train.py

does the same without the restart.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import platform
import sys
import time

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
# Seconds `settle` waits: with it the train step's heap stays flat over 120
# steps on 2 cores (`benchmarks/model/bench_host_memory.py`), a margin over the
# moment XLA:CPU takes to free a call's buffer.
SETTLE_S = 0.002


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


def reuse_host_memory() -> None:
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


def reusing(environ: Mapping[str, str] | None = None) -> bool:
  """Whether a process with `environ` (default `os.environ`) runs with every
  one of `TUNABLES` in its `GLIBC_TUNABLES`: restarted by
  `reuse_host_memory`, or started so by its user."""
  if environ is None:
    environ = os.environ
  current = set(environ.get(ENV, "").split(":"))
  return all(t in current for t in TUNABLES)


def settle() -> None:
  """Waits `SETTLE_S` when this process reuses host memory (`reusing`), so
  that XLA:CPU frees the call that just finished's temporary buffer before
  the next call asks for one; returns at once otherwise.

  Call it after a step's results are ready (a value read to the host).
  """
  if reusing():
    time.sleep(SETTLE_S)
