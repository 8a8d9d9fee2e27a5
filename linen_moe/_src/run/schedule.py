"""The optimizer of a training run: its settings from its options,
recorded with every checkpoint and continued by a resume, and the learning
rate of each step.

The settings (`settings`) are the learning rate, the schedule, its warmup,
its length (`steps` of the run that began it), its final ratio and the
weight decay; they go into each checkpoint's metadata as
`run.optimizer`. A resumed run (`resumed`) must ask for the same ones, or
it stops before any step; it keeps the schedule's length as the run began
it, so a run continued past its first `steps` goes on at the final rate
instead of stretching the schedule under the steps already taken. The
learning rate of step i is the schedule's value at the number of updates
applied before it (skipped steps apply none): `learning_rate`. A run with
an optimizer of its own (`RunOptions.optimizer`) records the schedule
"own" and no rate.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import os
from typing import Any

from linen_moe._src.config.schedules import DEFAULT_FINAL_LR_RATIO
from linen_moe._src.run.options import RunOptions

# Settings that a resumed run must repeat (`RunOptions` fields).
FIELDS = (
    "learning_rate",
    "lr_schedule",
    "warmup_steps",
    "final_lr_ratio",
    "weight_decay",
)
# The `lr_schedule` recorded for an optimizer of the user's own.
OWN = "own"


def settings(opts: RunOptions) -> dict[str, Any]:
  """The optimizer settings of a run's options (JSON-serialisable).

  Args:
    opts: the run's options (checked).

  Returns:
    {"learning_rate", "lr_schedule", "warmup_steps", "total_steps" (the
    schedule's length, `opts.steps`, for "cosine" and "linear"; else None),
    "final_lr_ratio" (resolved: `opts.final_lr_ratio` or the default, for
    "cosine" and "linear"; else None), "weight_decay"}; with
    `opts.optimizer`, "lr_schedule" is `OWN` and the others None.
  """
  if opts.optimizer is not None:
    return {
        "learning_rate": None,
        "lr_schedule": OWN,
        "warmup_steps": None,
        "total_steps": None,
        "final_lr_ratio": None,
        "weight_decay": None,
    }
  decaying = opts.lr_schedule != "constant"
  ratio = opts.final_lr_ratio
  if decaying and ratio is None:
    ratio = DEFAULT_FINAL_LR_RATIO
  return {
      "learning_rate": opts.learning_rate,
      "lr_schedule": opts.lr_schedule,
      "warmup_steps": opts.warmup_steps,
      "total_steps": opts.steps if decaying else None,
      "final_lr_ratio": ratio,
      "weight_decay": opts.weight_decay,
  }


def resumed(
    wanted: Mapping[str, Any],
    saved_run: Mapping[str, Any],
    where: str,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """The settings a resumed run continues with.

  Args:
    wanted: `settings` of this run's options.
    saved_run: the "run" metadata of the checkpoint it resumes.
    where: that checkpoint, for messages.
    log: where a note goes when the schedule keeps its saved length.

  Returns:
    `wanted` with the saved schedule length; `wanted` itself when the
    checkpoint recorded no optimizer (it predates the schedules).

  Raises:
    ValueError: naming each field whose value differs from the saved run's.
  """
  saved = saved_run.get("optimizer")
  if not isinstance(saved, dict):
    return dict(wanted)
  diffs = [
      f"`{key}` {wanted.get(key)!r} here, {saved.get(key)!r} there"
      for key in FIELDS
      if wanted.get(key) != saved.get(key)
  ]
  if diffs:
    same = " ".join(
        f"`{key}` {saved.get(key)}"
        for key in FIELDS
        if saved.get(key) is not None
    )
    run_dir = os.path.dirname(os.path.normpath(where))
    raise ValueError(
        f"The run in {where} has another optimizer: {'; '.join(diffs)}. "
        "A resume continues a run exactly: resume with its settings "
        f"({same}), or start a new run from its weights with these "
        f"settings: `init_from` {run_dir} and a new `checkpoint_dir`."
    )
  out = {**wanted, "total_steps": saved.get("total_steps")}
  if out["total_steps"] != wanted["total_steps"]:
    log(
        f"the {out['lr_schedule']} schedule keeps the length the run began "
        f"with, {out['total_steps']} steps (then its final rate)."
    )
  return out


def optimizer(run_settings: Mapping[str, Any], own: Any = None):
  """The run's optax optimizer and its learning-rate schedule.

  Args:
    run_settings: `settings` (or `resumed`) of the run.
    own: the user's optimizer (`RunOptions.optimizer`), or None.

  Returns:
    The pair `(optimizer, schedule)`: `own` and None, or
    `linen_moe.training.default_optimizer` of the settings and
    `learning_rate_schedule` of them (updates -> rate).
  """
  if own is not None:
    return own, None
  from linen_moe._src.training import optimizer as optim  # noqa: PLC0415 (jax)

  kwargs = {
      "schedule": run_settings["lr_schedule"],
      "warmup_steps": run_settings["warmup_steps"],
      "total_steps": run_settings["total_steps"],
      "final_lr_ratio": run_settings["final_lr_ratio"],
  }
  lr = run_settings["learning_rate"]
  return (
      optim.default_optimizer(
          lr, weight_decay=run_settings["weight_decay"], **kwargs
      ),
      optim.learning_rate_schedule(lr, **kwargs),
  )


def learning_rate(schedule: Callable, step: int, metrics: Mapping) -> float:
  """The learning rate step `step` (from 0) applied, or would have.

  Args:
    schedule: the run's schedule (updates applied -> rate).
    step: the step's index, from 0.
    metrics: the step's metrics, with "skipped" (0 or 1) and
      "skipped_steps" (steps skipped so far, this one included).

  Returns:
    `schedule(updates applied before the step)`, a float.
  """
  skipped_before = int(metrics["skipped_steps"]) - int(metrics["skipped"])
  return float(schedule(step - skipped_before))
