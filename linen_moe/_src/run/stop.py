"""Stopping a training loop on a signal, after the same step on every
process: `StopRequest`, and `RunInterrupted`, how a run reports it.

A scheduler that takes a machine back (a preemptible TPU VM, a spot GPU
node, a Kubernetes pod) sends SIGTERM and kills the process about 30 s
later; a person presses Ctrl-C (SIGINT). Inside a `StopRequest` either one
becomes a request that the loop reads where it chooses (after a step), so
the step in flight finishes, and the loop saves before it exits with
128 + the signal's number (143, 130), the shell's convention.

How the processes agree. In a group of processes (`jax.distributed`) the
signal may reach one of them, or each at another moment, and every one must
stop after the same step, or the others wait in the next collective for
ever. `should_stop` is itself a collective: each process gives the signal
it received (0: none) to an all-gather
(`jax.experimental.multihost_utils.process_allgather` of one int32; 1-3 ms
measured on 2 CPU processes over gloo), and all stop when any received one.

Why not jax's own preemption sync point
(`multihost_utils.reached_preemption_sync_point`, on by default in a group
of processes). It works on a CPU (measured here: a SIGTERM to one of two
processes stopped both at the same step), but it hears SIGTERM only, not
Ctrl-C; it does not exist in a single process; its C++ handler swallows
every later SIGTERM, so a second signal could not end a save that hangs;
and it stops one step later than needed (after the latest step any process
reached, plus one), a step taken out of the grace period. Entering a
`StopRequest` replaces its handler; leaving restores Python's previous one.

A second signal ends the process at once (`os._exit(128 + signum)`): a
save in flight is abandoned, and orbax's atomic commit (a temporary
directory renamed when complete) leaves the last committed checkpoint the
latest. One that comes within `REPEAT_S` of the first is the same request
sent twice, not a second one: a Slurm time limit sends every task SIGTERM
twice, 5 ms apart (measured, Slurm 22.05), and the task must still save.
The signals are heard by a thread reading Python's wakeup file
descriptor (`signal.set_wakeup_fd`), so the second one acts even while the
main thread waits inside a C call (a collective, a barrier of a save) where
no Python handler can run.

Imports no jax until `should_stop` runs in a group of processes.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import os
import signal as signal_module
import sys
import threading
import time
from typing import Any

from linen_moe._src.run.options import RunStopped


def signal_name(signum: int) -> str:
  """ "SIGTERM" for 15."""
  try:
    return signal_module.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


# A signal this soon after the first is a repeat of it (seconds).
REPEAT_S = 0.25
# Signals no handler can catch.
_UNCATCHABLE = frozenset({signal_module.SIGKILL, signal_module.SIGSTOP})


def _check_signals(signals: Any) -> tuple[int, ...]:
  """`signals` as signal numbers, or a TypeError / ValueError naming it."""
  allowed = (
      "expected a non-empty sequence of signal numbers (e.g. "
      "signal.SIGTERM), other than SIGKILL and SIGSTOP"
  )
  if isinstance(signals, (str, bytes)) or not isinstance(signals, Sequence):
    raise TypeError(f"StopRequest: signals={signals!r} is invalid: {allowed}.")
  valid = set(signal_module.valid_signals()) - _UNCATCHABLE
  for s in signals:
    if isinstance(s, bool) or not isinstance(s, int):
      raise TypeError(
          f"StopRequest: signals={signals!r} is invalid: {s!r} is not a "
          f"signal number; {allowed}."
      )
    if s not in valid:
      raise ValueError(
          f"StopRequest: signals={signals!r} is invalid: {int(s)} "
          f"({signal_name(s)}) cannot be handled; {allowed}."
      )
  if not signals:
    raise ValueError(f"StopRequest: signals={signals!r} is invalid: {allowed}.")
  return tuple(int(s) for s in signals)


class StopRequest:
  """Stop after a step when a signal arrives, on every process at once.

  A context manager: entering installs handlers for `signals` (replacing
  the defaults that end the process, and Ctrl-C's `KeyboardInterrupt`),
  leaving restores the previous ones (a `StopRequest` inside another one
  hears the signals until it is left). Enter it after
  `jax.distributed.initialize`, in the main thread: Python delivers
  signals there, and in another thread it installs nothing (`should_stop`
  then hears the other processes' signals only). In the example,
  `train_step` and `save` are the loop's own.

  Example usage:
    with StopRequest() as stop:
      for step in range(start, steps):
        state = train_step(state, batch(step))
        if stop.should_stop():  # every process, after the same step
          save(step + 1, state)
          break
    if stop.signal is not None:
      sys.exit(stop.exit_code)  # 143 for SIGTERM, 130 for Ctrl-C

  Args:
    signals: the signals that ask for a stop (signal numbers; not SIGKILL
      or SIGSTOP, which no process can catch).
    on_exit: called (without arguments) just before a second signal ends
      the process at once, e.g. to release a lock; its errors are ignored.

  Raises:
    TypeError: `signals` is not a sequence of ints, or `on_exit` is not
      callable.
    ValueError: `signals` is empty or names a signal no handler can catch.

  Attributes:
    signals: the signals handled.
    received: the first of them this process received, or None.
    signal: the signal every process stops for (the one received by the
      lowest-numbered process that received one), once `should_stop`
      returned True; else None.
  """

  def __init__(
      self,
      signals: Sequence[int] = (signal_module.SIGTERM, signal_module.SIGINT),
      *,
      on_exit: Callable[[], Any] | None = None,
  ):
    self.signals = _check_signals(signals)
    if on_exit is not None and not callable(on_exit):
      raise TypeError(
          f"StopRequest: on_exit={on_exit!r} is invalid: expected a callable "
          "taking no arguments, or None."
      )
    self.on_exit = on_exit
    self.received: int | None = None
    self.signal: int | None = None
    self._count = 0
    self._first_s: float | None = None  # when the first one was heard
    self._previous: dict[int, Any] = {}
    self._old_wakeup_fd = -1
    self._pipe: tuple[int, int] | None = None
    self._listener: threading.Thread | None = None

  @property
  def exit_code(self) -> int:
    """128 + `signal` (143 for SIGTERM, 130 for SIGINT); 0 when no stop
    was agreed."""
    return 0 if self.signal is None else 128 + self.signal

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is not threading.main_thread():
      return self
    read, write = os.pipe()
    os.set_blocking(write, False)
    self._pipe = (read, write)
    for s in self.signals:
      self._previous[s] = signal_module.signal(s, self._on_signal)
    self._old_wakeup_fd = signal_module.set_wakeup_fd(
        write, warn_on_full_buffer=False
    )
    self._listener = threading.Thread(
        target=self._listen, args=(read,), name="linen_moe-stop", daemon=True
    )
    self._listener.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._pipe is None:
      return
    signal_module.set_wakeup_fd(self._old_wakeup_fd)
    for s, previous in self._previous.items():
      signal_module.signal(
          s, signal_module.SIG_DFL if previous is None else previous
      )
    self._previous = {}
    read, write = self._pipe
    os.close(write)  # the listener reads the end of the pipe and returns
    self._listener.join(timeout=5)
    os.close(read)
    self._pipe = self._listener = None

  def _on_signal(self, signum: int, frame: Any) -> None:
    """Python's handler (main thread): the request is seen by the next
    `should_stop`, even one right after a signal this process sent itself.
    The listener counts the signals."""
    del frame
    if self.received is None:
      self.received = signum

  def _listen(self, fd: int) -> None:
    """Reads the signal numbers Python's C handler writes to the wakeup fd
    (one byte each), as they arrive; the second one ends the process."""
    while data := os.read(fd, 64):
      for signum in data:
        if signum not in self.signals:
          continue  # another signal with a Python handler
        if self.received is None:
          self.received = signum
        now = time.monotonic()
        if self._first_s is not None and now - self._first_s < REPEAT_S:
          continue  # the same request, sent twice
        self._first_s = self._first_s or now
        self._count += 1
        if self._count >= 2:
          self._exit_now(signum)

  def _exit_now(self, signum: int) -> None:
    """Says so on file descriptor 2 and ends the process. Python's buffered
    output is not flushed: the main thread may hold its lock."""
    line = (
        f"linen-moe: a second {signal_name(signum)}: exiting at once (a save "
        "in flight is abandoned; the last committed checkpoint stays the "
        "latest).\n"
    )
    try:
      os.write(2, line.encode())
    except OSError:
      pass
    if self.on_exit is not None:
      try:
        self.on_exit()
      except Exception:  # noqa: BLE001, S110
        pass
    os._exit(128 + signum)

  def should_stop(self) -> bool:
    """Whether to stop now: True on every process when any process
    received one of `signals` (then `signal` says which), the same answer
    everywhere; once True, True from then on.

    In a group of processes this is a collective (an all-gather of one
    int32): every process must call it at the same points of the loop,
    e.g. after each step. In one process it reads a flag.

    Returns:
      Whether the loop should stop (after saving) now.
    """
    if self.signal is not None:
      return True
    local = self.received or 0
    agreed = local
    if "jax" in sys.modules:
      import jax  # noqa: PLC0415

      if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415

        gathered = multihost_utils.process_allgather(np.int32(local))
        agreed = next((int(s) for s in np.ravel(gathered) if s), 0)
    if agreed:
      self.signal = agreed
    return self.signal is not None


class RunInterrupted(RunStopped):
  """A run stopped by a signal after a step (`StopRequest`): that step's
  checkpoint saved and committed, its metrics row written. Public as the
  `RunStopped` it is, whose `signal` is set.

  Attributes:
    signal: the signal's number (15 for SIGTERM, 2 for SIGINT).
    step: the last step the run took (the one saved).
    steps: the steps the run was to take.
    checkpoint: the directory of the checkpoint of `step` (saved by the
      stop, or the one the run resumed from when it stopped before its
      first step), or None (no checkpoint directory, or none yet).
    exit_code: 128 + `signal`, what `linen-moe train` exits with.
  """

  def __init__(
      self, signal: int, step: int, steps: int, checkpoint: str | None
  ):
    self.signal, self.step, self.steps = signal, step, steps
    self.checkpoint = checkpoint
    self.exit_code = 128 + signal
    if checkpoint is not None:
      saved = f"its checkpoint is {checkpoint}"
    elif step:
      saved = "nothing saved (no checkpoint directory)"
    else:
      saved = "nothing to save"
    super().__init__(
        f"stopped by {signal_name(signal)} after step {step} of {steps}; "
        f"{saved}."
    )
