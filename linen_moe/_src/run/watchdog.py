"""A hang is an error, not a wait: `Watchdog`, the `step_timeout` of a run.

A job of several hosts hangs when one host stalls (a kernel that never
returns, a lost network link, a stuck file system): the others wait in the
next collective for ever, and the slice is paid for while nothing trains.
A `Watchdog` times each phase of each step of a run (`PHASES`: "data",
"step", "eval", "stop agreement", "save"). A phase that runs past the limit
writes one line naming the step, the phase and the limit, then every
thread's stack (`faulthandler`), to stderr and to the run directory
(`DIR/stacks.process_<i>.txt`, appended), and ends the process with
`STEP_TIMEOUT_EXIT` (75, sysexits.h's `EX_TEMPFAIL`: a transient failure,
try again), so that a scheduler restarts the job from its last checkpoint.
Every process watches itself: the one that hangs, and each one waiting for
it in a collective, runs past the limit.

The limit (`RunOptions.step_timeout`, in seconds):

- N > 0: every phase, except the first train step and the first
  evaluation of the run, which compile;
- 0: off;
- None (the default): off on a CPU. On an accelerator, once the
  `AUTO_STEPS` steps after the first have run, `AUTO_MULTIPLE` times their
  median step time, and at least `AUTO_MIN_S`; it then watches only the
  phases a step's time bounds (`AUTO_PHASES`: data, step, stop agreement),
  not saves and evaluations, whose time the checkpoint's size and the
  held-out set set.

The watching is a Python thread woken at each deadline. A main thread that
waits in a collective, on a device or in `time.sleep` lets it run; one that
holds the interpreter inside a C call would not (none of the run's does).

Imports no jax.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import dataclasses
import datetime
import faulthandler
import os
import statistics
import sys
import threading
import time
from typing import Any

STEP_TIMEOUT_EXIT = 75
PHASES = ("data", "step", "eval", "stop agreement", "save")
# Phases whose first run compiles a program: never watched the first time.
COMPILING_PHASES = ("step", "eval")
AUTO_STEPS = 5
AUTO_MULTIPLE = 20
AUTO_MIN_S = 300.0
AUTO_PHASES = ("data", "step", "stop agreement")
STACKS_FILE = "stacks.process_{index}.txt"


@dataclasses.dataclass(frozen=True)
class _Phase:
  name: str
  step: int
  start: float
  limit: float | None


def _stderr_fd() -> int:
  try:
    return sys.stderr.fileno()
  except (AttributeError, OSError, ValueError):  # captured (a StringIO)
    return 2


class Watchdog:
  """Times the phases of a run's steps; one past the limit ends the
  process (see the module's docstring).

  Example usage:

    with Watchdog(30.0, platform="gpu", directory=run_dir) as watch:
      for step in range(1, steps + 1):
        with watch.phase("step", step):
          state = train_step(state, batch)

  Args:
    step_timeout: seconds > 0, 0 (off) or None (the default rule: off on a
      CPU, from the median step on an accelerator).
    platform: the platform the steps run on ("cpu", "gpu", "tpu"; jax's
      `default_backend()`).
    directory: where the stacks are written too (None: stderr only).
    process: this process's index and the number of processes.
    on_exit: called (without arguments) before a timeout ends the process,
      e.g. to release a lock; its errors are ignored.

  Attributes:
    limit: the limit in force now, in seconds (None: nothing is watched
      now).
  """

  def __init__(
      self,
      step_timeout: float | None,
      *,
      platform: str,
      directory: str | None = None,
      process: tuple[int, int] = (0, 1),
      on_exit: Callable[[], Any] | None = None,
  ):
    self.auto = step_timeout is None and platform != "cpu"
    self.limit = step_timeout or None
    self.directory, self.process, self.on_exit = directory, process, on_exit
    self._seen: set[str] = set()
    self._steps: list[float] = []
    self._current: _Phase | None = None
    self._closed = False
    self._cond = threading.Condition()
    self._thread = None
    if self.auto or self.limit is not None:
      self._thread = threading.Thread(
          target=self._watch, name="linen_moe-watchdog", daemon=True
      )
      self._thread.start()

  def __enter__(self) -> Watchdog:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stops watching."""
    with self._cond:
      self._closed = True
      self._cond.notify()
    if self._thread is not None:
      self._thread.join(timeout=5)

  def _limit_of(self, name: str) -> float | None:
    if name in COMPILING_PHASES and name not in self._seen:
      return None
    if self.auto and name not in AUTO_PHASES:
      return None
    return self.limit

  @contextlib.contextmanager
  def phase(self, name: str, step: int):
    """Watches the body as phase `name` of step `step`.

    Args:
      name: one of `PHASES`.
      step: the step (from 1) the phase belongs to.

    Yields:
      Nothing; the phase ends with the body.
    """
    if name not in PHASES:
      raise ValueError(f"phase={name!r} is invalid: expected one of {PHASES}.")
    first = name not in self._seen
    start = time.monotonic()
    if self._thread is not None:
      with self._cond:
        self._current = _Phase(name, step, start, self._limit_of(name))
        self._cond.notify()
    try:
      yield
    finally:
      if self._thread is not None:
        with self._cond:
          self._current = None
      self._seen.add(name)
      if name == "step" and not first and self.auto:
        self._record_step(time.monotonic() - start)

  def _record_step(self, seconds: float) -> None:
    """The default rule on an accelerator: the limit from the median of
    the first `AUTO_STEPS` steps after the first."""
    if len(self._steps) >= AUTO_STEPS:
      return
    self._steps.append(seconds)
    if len(self._steps) == AUTO_STEPS:
      self.limit = auto_limit(self._steps)

  def describe(self) -> str:
    """The limit in words, e.g. "step_timeout 30s"."""
    if self.auto and self._steps:
      median = statistics.median(self._steps)
      return (
          f"the step timeout {self.limit:g}s (the default: {AUTO_MULTIPLE} x "
          f"the median step {median:.3g}s, at least {AUTO_MIN_S:g}s)"
      )
    return f"step_timeout {self.limit:g}s"

  def _watch(self) -> None:
    with self._cond:
      while not self._closed:
        current = self._current
        if current is None or current.limit is None:
          self._cond.wait()
          continue
        left = current.start + current.limit - time.monotonic()
        if left > 0:
          self._cond.wait(left)
          continue
        self._fire(current)

  def _fire(self, phase: _Phase) -> None:
    """Reports the phase that ran past the limit, with every thread's
    stack, and ends the process."""
    index, count = self.process
    path = None
    if self.directory is not None:
      path = os.path.join(self.directory, STACKS_FILE.format(index=index))
    where = f" (also in {path})" if path else ""
    line = (
        f"linen-moe: step {phase.step}: {phase.name} ran past "
        f"{self.describe()} on process {index} of {count}; every thread's "
        f"stack follows{where}. Exit status {STEP_TIMEOUT_EXIT}.\n"
    )
    # Straight to the file descriptors, without Python's buffered streams,
    # whose lock the hung thread may hold.
    fd = _stderr_fd()
    with contextlib.suppress(OSError):
      os.write(fd, line.encode())
      faulthandler.dump_traceback(fd, all_threads=True)
    if path is not None:
      with contextlib.suppress(OSError):
        with open(path, "a", encoding="utf-8") as f:
          now = datetime.datetime.now(datetime.UTC).isoformat("T", "seconds")
          f.write(f"{now} {line}")
          f.flush()
          faulthandler.dump_traceback(f, all_threads=True)
          f.flush()
          os.fsync(f.fileno())
    if self.on_exit is not None:
      with contextlib.suppress(Exception):
        self.on_exit()
    os._exit(STEP_TIMEOUT_EXIT)


def auto_limit(step_seconds: list[float]) -> float:
  """The default limit on an accelerator: `AUTO_MULTIPLE` times the median
  of `step_seconds`, at least `AUTO_MIN_S`.

  Args:
    step_seconds: the times of the steps after the first (`AUTO_STEPS` of
      them in a run).

  Returns:
    The limit in seconds.
  """
  return max(AUTO_MULTIPLE * statistics.median(step_seconds), AUTO_MIN_S)
