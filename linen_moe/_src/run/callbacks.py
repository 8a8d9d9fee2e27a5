"""What watches a run: `Callback`s, each told of the start, of every step
and of the end, and the run's own (progress, throughput, profiler,
held-out loss, TensorBoard, checkpoints), built the same way.

After each step the run calls, in order: the throughput, the held-out
loss (with `eval_every`), the user's callbacks, TensorBoard, the progress
report and the profiler; then every process agrees whether to stop (a
signal, or a callback that asked to stop or raised, on any process); then
the checkpoints record the step (and save it when the run stops). A
callback adds scalars to `StepInfo.metrics`, and the metrics row and
TensorBoard record them. A user's callback whose `name` is a default's
("progress", "throughput", "profiler", "evaluation", "tensorboard",
"checkpoints") takes that one's place.

Example usage (an evaluation every 10 steps that stops early):

  class EarlyStop(linen_moe.training.Callback):
    def after_step(self, run, step):
      if step.step % 10 == 0:
        loss = my_eval(run.variables(step.state))
        step.metrics["my_eval_loss"] = loss
        if loss < 2.0:
          run.stop(f"eval loss {loss:.3f} < 2.0")

  linen_moe.training.run(options, callbacks=[EarlyStop()])
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
from typing import Any


class Callback:
  """An observer of a training run (`linen_moe.training.run(...,
  callbacks=...)`); every method does nothing unless overridden.

  A callback runs on every process (a group's run calls it in step). An
  exception from `after_step` stops the run as a SIGTERM does: the step
  is saved (with a `checkpoint_dir`), and the run raises `RunStopped`
  naming the callback, the exception its `__cause__`.

  Attributes:
    name: a default observer's name to replace ("progress", ...), or None
      (the class's name, added to the defaults).
    phase: the `step_timeout` phase its `after_step` is watched as
      ("eval", "save"), or None (unwatched).
  """

  name: str | None = None
  phase: str | None = None

  def on_start(self, run: RunInfo) -> None:
    """Before the first step (after the state is restored or built).

    Args:
      run: the run (`RunInfo`: its options, config, start step, ...).
    """

  def after_step(self, run: RunInfo, step: StepInfo) -> None:
    """After each step, its loss on the host.

    Args:
      run: the run; `run.stop(reason)` ends it after this step.
      step: the step (`StepInfo`: its number, loss, metrics, state).
    """

  def on_end(self, run: RunInfo, error: BaseException | None) -> None:
    """Once, when the run ends (after a failed start too, once started).

    Args:
      run: the run.
      error: what ends it, or None (it ran to its `steps`, or a callback
        stopped it).
    """


@dataclasses.dataclass
class StepInfo:
  """One step, as the callbacks see it.

  Attributes:
    step: its number, from 1.
    loss: its cross-entropy (NaN when skipped).
    metrics: its metrics (`cross_entropy`, `skipped`, `learning_rate`,
      `expert_load`, ...); a callback adds scalars for the metrics row.
    state: the train state after it (the front end's; `RunInfo.variables`
      gives the model's variables).
    seconds: its time, from fetching its batch to its loss on the host.
    skipped: the steps skipped so far in this call of `run`.
    stopping: set for the checkpoints: the run stops after this step.
  """

  step: int
  loss: float
  metrics: dict
  state: Any
  seconds: float
  skipped: int = 0
  stopping: bool = False


class RunInfo:
  """The run, as the callbacks see it.

  Attributes:
    options: the run's `RunOptions`.
    config: the `ModelConfig` it trains.
    frontend: its `TrainingFrontend`.
    start_step: the step it started from (0, or the resumed one).
    steps: the step it trains up to.
    checkpoints: its `RunCheckpoints` (`steps()`, `meta(step)`,
      `step_dir(step)`), or None without a `checkpoint_dir`.
    main_process: whether this is process 0 (which alone writes files).
    stop_reason: why a callback asked the run to stop, or None.
  """

  def __init__(
      self,
      options,
      config,
      frontend,
      start_step: int,
      checkpoints,
      main_process: bool,
      log: Callable[[str], None],
  ):
    self.options, self.config, self.frontend = options, config, frontend
    self.start_step, self.steps = start_step, options.steps
    self.checkpoints, self.main_process = checkpoints, main_process
    self.stop_reason: str | None = None
    self._log = log
    self._write = log

  def stop(self, reason: str) -> None:
    """Ends the run after this step, saved (with a `checkpoint_dir`) as a
    SIGTERM's is, on every process; `RunResult.stop_reason` says why."""
    self.stop_reason = self.stop_reason or str(reason)

  def log(self, line: str) -> None:
    """A message between steps (above a progress bar), on process 0."""
    if self.main_process:
      self._write(line)

  def variables(self, state) -> dict:
    """The model's variables of a train state (what `Decoder.apply` takes:
    params, and the fp8 and routing state where there are any)."""
    from linen_moe._src.training import evaluation  # noqa: PLC0415

    return evaluation.variables_of(self.frontend, state)


class Throughput(Callback):
  """Adds a step's tokens per second, model TFLOP/s and MFU."""

  name = "throughput"

  def __init__(self, meter):
    self.meter = meter  # throughput.Throughput

  def after_step(self, run, step):
    step.metrics.update(self.meter.of(step.seconds))


class HeldOut(Callback):
  """The held-out loss and perplexity at every `every`-th step
  (`eval_loss`, `eval_perplexity`), printed and recorded."""

  name, phase = "evaluation", "eval"

  def __init__(self, evaluate: Callable[[Any], float], every: int):
    self.evaluate, self.every = evaluate, every
    self.losses: list[tuple[int, float]] = []

  def after_step(self, run, step):
    if step.step % self.every:
      return
    loss = self.evaluate(step.state)
    self.losses.append((step.step, loss))
    perplexity = math.exp(min(loss, 700.0))
    step.metrics.update(eval_loss=loss, eval_perplexity=perplexity)
    run.log(
        f"step {step.step}: held-out loss {loss:.4f}, perplexity "
        f"{perplexity:.2f} (train loss {step.loss:.4f})"
    )


class TensorBoard(Callback):
  """Each step's scalars as TensorBoard events (process 0)."""

  name = "tensorboard"

  def __init__(self, board):
    self.board = board  # throughput.TensorBoard

  def after_step(self, run, step):
    self.board.write(step.step, step.metrics)

  def on_end(self, run, error):
    self.board.close()


class Profiler(Callback):
  """Traces steps A to B with `jax.profiler` (from the end of step A - 1)."""

  name = "profiler"

  def __init__(self, profiler):
    self.profiler = profiler  # throughput.Profiler

  def on_start(self, run):
    self.profiler.before(run.start_step + 1)

  def after_step(self, run, step):
    self.profiler.after(step.step)
    self.profiler.before(step.step + 1)

  def on_end(self, run, error):
    self.profiler.close()


class Progress(Callback):
  """The progress bar, or a line every `log_every` steps (process 0)."""

  name = "progress"

  def __init__(self, make_report: Callable[[RunInfo], Any]):
    self.make_report = make_report
    self.report = None

  def on_start(self, run):
    self.report = self.make_report(run)
    run._write = self.report.write  # noqa: SLF001 (lines above the bar)

  def after_step(self, run, step):
    speed = {
        k: step.metrics[k] for k in ("tokens_per_s", "mfu") if k in step.metrics
    }
    self.report.step(
        step.step,
        step.loss,
        step.metrics.get("learning_rate"),
        step.skipped,
        speed,
    )

  def on_end(self, run, error):
    if self.report is not None:
      self.report.close()


class Checkpoints(Callback):
  """Appends each step's metrics row, saves when due or when the run
  stops (`StepInfo.stopping`: on disk before the run ends), and charts the
  losses at the end of a run on real data."""

  name, phase = "checkpoints", "save"

  def __init__(self, ckpts, meta: dict, recipe: dict, tree_of, source, log):
    self.ckpts, self.meta, self.recipe = ckpts, meta, recipe
    self.tree_of, self.source, self.log = tree_of, source, log

  def on_start(self, run):
    self.ckpts.begin(run.start_step, self.meta)

  def after_step(self, run, step):
    row = step.metrics
    if step.step == 1:
      row = {**row, "recipe": self.recipe}
    self.ckpts.after_step(
        step.step,
        row,
        self.tree_of,
        step.state,
        data=self.source.iterator,
        force=step.stopping,
    )
    if step.stopping:
      self.ckpts.wait(step.step)

  def on_end(self, run, error):
    from linen_moe._src.run import loss_chart  # noqa: PLC0415

    if error is None and run.options.data is not None and run.main_process:
      loss_chart.chart_beside(self.ckpts.metrics_path, self.log)


# The defaults' order before the stop agreement (the user's callbacks go
# after "evaluation"); "checkpoints" comes after it.
BEFORE_USERS = ("throughput", "evaluation")
AFTER_USERS = ("tensorboard", "progress", "profiler")


def arrange(
    defaults: dict[str, Callback], users: list[Callback]
) -> tuple[list[Callback], Callback | None]:
  """The callbacks in calling order, and the one that records the stopping
  step (the checkpoints', or its replacement), called after the agreement.

  Args:
    defaults: the run's own, by name (those it has).
    users: the user's; one named as a default takes its place.

  Returns:
    (the callbacks called before the agreement, the last one or None).

  Raises:
    TypeError: a user's callback is not a `Callback`.
  """
  for cb in users:
    if not isinstance(cb, Callback):
      raise TypeError(
          f"callbacks: {cb!r} is not a linen_moe.training.Callback."
      )
  defaults = dict(defaults)
  added = []
  for cb in users:
    if cb.name in (*BEFORE_USERS, *AFTER_USERS, "checkpoints"):
      defaults[cb.name] = cb
    else:
      added.append(cb)
  before = [defaults[n] for n in BEFORE_USERS if n in defaults]
  after = [defaults[n] for n in AFTER_USERS if n in defaults]
  return [*before, *added, *after], defaults.get("checkpoints")


def failure(name: str, error: BaseException, step: int, saved: str | None):
  """The `RunStopped` message of a run a callback's exception stopped."""
  where = f"step {step} saved in {saved}" if saved else "nothing saved"
  text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
  return (
      f"callback {name} failed after step {step} ({text}); the run stopped, "
      f"{where}."
  )


def callback_name(cb: Callback) -> str:
  return cb.name or type(cb).__name__
