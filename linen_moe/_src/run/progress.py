"""How a run shows its steps: a progress bar on a terminal, a line every
`log_every` steps in a log.

A bar redraws itself in place, which a terminal shows as one line and a
log file keeps as every redraw (tens of kilobytes of carriage returns), so
the bar is drawn only when both standard streams are terminals and the
run asked for one (`RunOptions.progress`); otherwise the run writes one
line per `log_every` steps, and its first and last:

    step 10/200: loss 3.2161, lr 0.01, 8.1e+04 tok/s, 0 skipped, 4s

Either shows the best achievable loss only where the data has one (the
synthetic Markov data; real text's is unknown, not NaN). Only process 0
shows anything.
"""

from __future__ import annotations

from collections.abc import Callable
import math
import sys
import time

import tqdm


def _terminal() -> bool:
  return sys.stdout.isatty() and sys.stderr.isatty()


def speed_postfix(speed: dict[str, float]) -> dict[str, str]:
  """The throughput fields of a step's report."""
  out = {"tok/s": f"{speed['tokens_per_s']:.3g}"}
  if "mfu" in speed:
    out["mfu"] = f"{speed['mfu']:.1%}"
  return out


class StepReport:
  """The steps `start + 1 .. steps` of a run, iterated as their indices
  (from 0, as `range(start, steps)`), each reported with `step`.

  Attributes:
    bar: the tqdm bar (disabled when lines are written instead).
    lines: whether a line per `every` steps is written (`log`).
  """

  def __init__(
      self,
      start: int,
      steps: int,
      *,
      main: bool,
      bar: bool,
      every: int,
      best_loss: float,
      log: Callable[[str], None] = print,
  ):
    interactive = main and bar and _terminal()
    self.bar = tqdm.tqdm(
        total=steps - start, disable=not interactive, desc="train"
    )
    self.lines = main and not interactive
    self.start, self.steps, self.every, self.log = start, steps, every, log
    self.best = best_loss if math.isfinite(best_loss) else None
    self._began = time.perf_counter()
    self._unwritten = None  # the last step's line, when it was not due

  def __iter__(self):
    return iter(range(self.start, self.steps))

  def close(self) -> None:
    """Ends the bar; with lines, writes the last reported step's line if
    it was not due (a run stopped between two lines ends on its line)."""
    if self._unwritten is not None:
      self.log(self._unwritten)
      self._unwritten = None
    self.bar.close()

  def step(
      self,
      done: int,
      loss: float,
      learning_rate: float | None,
      skipped: int,
      speed: dict[str, float],
  ) -> None:
    """Reports step `done` (from 1): the bar's fields, or its line when it
    is due (every `every` steps, the first and the last); `learning_rate`
    None: unknown (an optimizer of the user's own)."""
    self.bar.update(1)
    fields = {"loss": f"{loss:.3f}"}
    if self.best is not None:
      fields["best"] = f"{self.best:.3f}"
    self.bar.set_postfix(**fields, skipped=skipped, **speed_postfix(speed))
    if not self.lines:
      return
    rates = ", ".join(f"{v} {k}" for k, v in speed_postfix(speed).items())
    best = "" if self.best is None else f" (best {self.best:.4f})"
    lr = "" if learning_rate is None else f", lr {learning_rate:.3g}"
    line = (
        f"step {done}/{self.steps}: loss {loss:.4f}{best}{lr}, "
        f"{rates}, {skipped} skipped, "
        f"{time.perf_counter() - self._began:.0f}s"
    )
    due = done % self.every == 0 or done in (self.start + 1, self.steps)
    self._unwritten = None if due else line
    if due:
      self.log(line)

  def write(self, line: str) -> None:
    """A message between steps (e.g. a held-out loss), above the bar."""
    if self.lines:
      self.log(line)
    elif not self.bar.disable:
      self.bar.write(line)
