"""The checkpoints and per-step metrics of one training run.

A run with a `checkpoint_dir` DIR resumes from the newest checkpoint in DIR
that reads (or the one `resume_step` names), in any front end, layer mode
or mesh (`linen_moe.checkpoint` restores into the run's own state); saves
every `save_every` steps and always its last; and appends one JSON object
per step to `DIR/metrics.jsonl`. What that guarantees:

- No lost rows: the metrics file is flushed to disk before each save, and
  each checkpoint holds its own step's row, so a resumed run rewrites the
  file's tail: the rows before its step, then that step's row from the
  checkpoint (whatever was torn), then its own. Each step is there once,
  in order.
- A damaged checkpoint is skipped: the newest one that reads is restored,
  with a message for each one skipped; the ones newer than the step resumed
  from (damaged, or passed over by `resume_step`) are set aside as
  `DIR/<step>.damaged` or `DIR/<step>.superseded`, never deleted.
- A save that fails (a full disk, a refused write) stops the run with
  `RunStopped`, naming the last complete checkpoint, which orbax's
  atomic commit leaves restorable.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import logging
import os
import re
from typing import Any

import jax
import numpy as np

from linen_moe._src.checkpoint import manager
from linen_moe._src.checkpoint import meta as ckpt_meta
from linen_moe._src.parallel import distributed
from linen_moe._src.run.options import RunStopped

METRICS_FILE = "metrics.jsonl"


def _json_value(x: Any) -> Any:
  value = np.asarray(jax.device_get(x))
  return value.item() if value.ndim == 0 else value.tolist()


def _reason(error: BaseException) -> str:
  """A short reason for a failed write: the OS's words where there are."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  text = str(error)
  code = re.search(r"os_error_code='(\d+)'|\[Errno (\d+)\]", text)
  if code:
    return os.strerror(int(code.group(1) or code.group(2)))
  first = text.strip().splitlines()[0] if text.strip() else ""
  return f"{type(error).__name__}: {first[:200]}"


def _everywhere(flag: bool) -> bool:
  """`flag` and-ed over every process (the processes decide together)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # noqa: PLC0415

  return bool(np.all(multihost_utils.process_allgather(np.array(flag))))


class _QuietOrbaxErrors(logging.Filter):
  """Drops orbax's own error logs (tracebacks of a failed background save):
  the run reports the failure itself, in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (
        record.levelno >= logging.ERROR
        and f"{os.sep}orbax{os.sep}" in record.pathname
    )


class RunCheckpoints:
  """`linen_moe.checkpoint.Checkpoints` of a training run, its saving policy and its
  metrics file.

  Attributes:
    checkpoints: the run's `linen_moe.checkpoint.Checkpoints`.
    metrics_path: `DIR/metrics.jsonl`.
  """

  def __init__(
      self,
      directory: str,
      *,
      steps: int,
      save_every: int | None,
      keep: int,
      log: Callable[[str], None] = print,
  ):
    self.last_step, self.save_every, self.log = steps, save_every or steps, log
    self._quiet = _QuietOrbaxErrors()
    logging.getLogger("absl").addFilter(self._quiet)
    self.checkpoints = manager.Checkpoints(
        directory, save_every=self.save_every, keep=keep
    )
    self.directory = self.checkpoints.directory
    self.metrics_path = os.path.join(self.directory, METRICS_FILE)
    self.main_process = distributed.is_main_process()
    self.run_meta: dict = {}
    self._resumed_row: dict | None = None
    self._saving: int | None = None  # the step of the last save started

  def close(self, *, report: bool = True) -> None:
    """Waits for the last save to be on disk; a failed one is a
    `RunStopped` (unless `report` is False: the run is failing already)."""
    try:
      self.checkpoints.close()
    except Exception as e:  # noqa: BLE001 (orbax's, from the save thread)
      if report:
        raise self._stopped(e, self.last_step) from e
    finally:
      logging.getLogger("absl").removeFilter(self._quiet)

  def steps(self) -> list[int]:
    """The steps of the checkpoints in the directory, oldest first."""
    return self.checkpoints.all_steps()

  def meta(self, step: int) -> dict:
    """The metadata of checkpoint `step` (model config, RNG, data, run).

    Raises:
      DamagedCheckpointError: it cannot be read.
    """
    return self.checkpoints.meta(step)

  def step_dir(self, step: int) -> str:
    """The directory of checkpoint `step`."""
    return self.checkpoints.step_dir(step)

  def restore_data(self, iterator, step: int):
    """`iterator` (a Grain iterator) moved to the state saved with
    checkpoint `step`."""
    return self.checkpoints.restore_data(iterator, step)

  def latest_step(self) -> int | None:
    """The newest checkpoint whose metadata reads (None: there is none)."""
    for step in reversed(self.checkpoints.all_steps()):
      try:
        self.checkpoints.meta(step)
      except manager.DamagedCheckpointError:
        continue
      return step
    return None

  def resume(
      self,
      fe,
      run,
      cfg,
      optimizer,
      first,
      seed: int,
      fresh_fp8_state: bool,
      resume_step: int | None = None,
      check_data: Callable[[dict, str], None] | None = None,
  ):
    """(step, state, rng) of the newest checkpoint that reads (or of
    `resume_step`), restored into `fe`'s state (sharded as `run`'s, if any)
    straight from disk; an abstract target unless a fresh fp8 state needs
    initial values. `check_data(saved_data_meta, step_dir)` raises when the
    checkpoint's data is not this run's.

    Raises:
      ValueError: `resume_step` is not a checkpoint, or cannot be read; no
        checkpoint reads; or one that reads is of another run (seed, model,
        data).
    """
    steps = self.checkpoints.all_steps()
    if resume_step is not None and resume_step not in steps:
      raise ValueError(
          f"`resume_step` {resume_step}: {self.directory} holds no checkpoint "
          f"of that step; it holds steps {steps or 'none'}."
      )
    rng = jax.random.key(seed)
    if fresh_fp8_state:
      target = (
          run.init(first, rng) if run else fe.init(cfg, optimizer, first, rng)
      )
    elif run is not None:
      target = run.abstract_state(first, rng)
    else:
      target = jax.eval_shape(
          lambda t, r: fe.init(cfg, optimizer, t, r), first, rng
      )
    tree = fe.checkpoint_tree(target)
    candidates = list(reversed(steps)) if resume_step is None else [resume_step]
    damaged: dict[int, str] = {}
    restored = None
    for step in candidates:
      try:
        restored = self._restore(
            step, tree, cfg, seed, fresh_fp8_state, check_data
        )
        problem = None
      except manager.DamagedCheckpointError as e:
        problem = str(e)
      if _everywhere(problem is None):
        break
      restored = None
      damaged[step] = problem or (
          f"Checkpoint {self.checkpoints.step_dir(step)} cannot be read on "
          "another process."
      )
      self.log(f"skipped checkpoint {step}: {damaged[step]}")
    if restored is None:
      listed = ", ".join(f"{s} ({why})" for s, why in damaged.items())
      raise ValueError(
          f"no checkpoint in {self.directory} can be read: {listed}. Start "
          "again with another `checkpoint_dir`, or move them away."
      )
    self._set_aside({
        s: "damaged" if s in damaged else "superseded"
        for s in steps
        if s > restored.step
    })
    state = fe.from_checkpoint_tree(restored.tree, target)
    note = " with fresh fp8 state" if restored.fresh_fp8_state else ""
    self.log(f"resumed from step {restored.step}{note} ({self.directory})")
    self._resumed_row = restored.meta.get("metrics")
    return restored.step, state, ckpt_meta.rng_from_json(restored.meta["rng"])

  def _restore(self, step, tree, cfg, seed, fresh_fp8_state, check_data):
    meta = self.checkpoints.meta(step)
    saved_seed = meta.get("run", {}).get("seed")
    if saved_seed != seed:
      raise ValueError(
          f"`seed` {seed} differs from the seed {saved_seed} of the run in "
          f"{self.directory}; resume with `seed` {saved_seed} or use a new "
          "`checkpoint_dir`."
      )
    if check_data is not None:
      check_data(meta.get("data", {}), self.checkpoints.step_dir(step))
    return self.checkpoints.restore(
        tree, step, config=cfg, fresh_fp8_state=fresh_fp8_state
    )

  def _set_aside(self, reasons: dict[int, str]) -> None:
    """Renames checkpoints newer than the resumed one out of the way (the
    run saves those steps again), keeping their files."""
    if not reasons:
      return
    if self.main_process:
      for step, reason in sorted(reasons.items()):
        source = self.checkpoints.step_dir(step)
        target, n = f"{source}.{reason}", 1
        while os.path.lexists(target):
          n += 1
          target = f"{source}.{reason}.{n}"
        os.rename(source, target)
        why = "" if reason == "damaged" else " (newer than `resume_step`)"
        self.log(f"set checkpoint {step} aside as {target}{why}")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # noqa: PLC0415

      multihost_utils.sync_global_devices("linen_moe run set aside")
    self.checkpoints.reload()

  def begin(self, start: int, meta: dict) -> None:
    """Starts recording at step `start` (0 or the resumed step); `meta` (the
    model config, the RNG, the data and run settings) goes with every
    checkpoint. Rewrites the metrics file as steps 1..start: its rows before
    `start`, then the resumed checkpoint's own row."""
    self.run_meta = meta
    if not self.main_process:
      return
    rows: dict[int, str] = {}
    if os.path.exists(self.metrics_path):
      with open(self.metrics_path, encoding="utf-8") as f:
        for line in f:
          try:  # a line without its newline was torn by a killed run
            step = json.loads(line)["step"] if line.endswith("\n") else None
          except (ValueError, KeyError, TypeError):
            step = None
          if isinstance(step, int) and 0 < step < start:
            rows.setdefault(step, line)
    if start and self._resumed_row is not None:
      rows[start] = json.dumps(self._resumed_row) + "\n"
    missing = [s for s in range(1, start + 1) if s not in rows]
    if missing:
      self.log(
          f"{self.metrics_path} lacks the rows of steps {_ranges(missing)}: "
          "lost before this resume, they cannot be written again."
      )
    self._write_atomically([rows[s] for s in sorted(rows)])

  def _write_atomically(self, lines: list[str]) -> None:
    tmp = f"{self.metrics_path}.tmp-{os.getpid()}"
    try:
      with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, self.metrics_path)
    except OSError as e:
      raise RunStopped(
          f"writing {self.metrics_path} failed ({_reason(e)}) before the "
          "first step; the run stopped."
      ) from e

  def after_step(
      self,
      done: int,
      metrics: dict,
      tree_of,
      state,
      data: Any = None,
      force: bool = False,
  ) -> None:
    """Appends step `done`'s metrics; saves `tree_of(state)` (and the state
    of `data`, a Grain iterator, if given) when due, or `force`d (a run
    that stops early).

    Raises:
      RunStopped: the metrics cannot be written, or a save failed
        (this one, or an earlier one found failed).
    """
    record = {"step": done, **{k: _json_value(v) for k, v in metrics.items()}}
    due = force or done % self.save_every == 0 or done == self.last_step
    if self.main_process:
      try:
        with open(self.metrics_path, "a", encoding="utf-8") as f:
          f.write(json.dumps(record) + "\n")
          if due:  # the rows before a checkpoint are on disk before it
            f.flush()
            os.fsync(f.fileno())
      except OSError as e:
        self._raise_save_error(done)
        raise RunStopped(
            f"writing {self.metrics_path} failed at step {done} ({_reason(e)});"
            f" the run stopped. {self._last_complete()}"
        ) from e
    try:
      self.checkpoints.check_for_errors()
    except Exception as e:  # noqa: BLE001 (orbax's, from the save thread)
      raise self._stopped(e, done) from e
    if due:
      self._raise_save_error(done)  # the previous save, if it failed
      meta = {
          **self.run_meta,
          "data": {**self.run_meta["data"], "position": done},
          "metrics": record,
      }
      self._saving = done
      try:
        self.checkpoints.save(done, tree_of(state), meta, force=True, data=data)
      except Exception as e:  # noqa: BLE001
        raise self._stopped(e, done) from e

  def wait(self, done: int) -> None:
    """Waits until the save in flight is on disk and committed.

    Raises:
      RunStopped: it failed (naming the last complete checkpoint); `done`
        is the step the run stopped after.
    """
    self._raise_save_error(done)

  def _raise_save_error(self, done: int) -> None:
    """Waits for the save in flight; raises its failure, if it failed."""
    try:
      self.checkpoints.wait_until_finished()
      self.checkpoints.check_for_errors()
    except Exception as e:  # noqa: BLE001 (orbax's, from the save thread)
      raise self._stopped(e, done) from e

  def _stopped(self, error: BaseException, done: int) -> RunStopped:
    return RunStopped(
        f"saving checkpoint {self._saving} in {self.directory} failed "
        f"({_reason(error)}); the run stopped after step {done}. "
        f"{self._last_complete()}"
    )

  def _last_complete(self) -> str:
    try:
      self.checkpoints.reload()
      last = self.latest_step()
    except Exception:  # noqa: BLE001 (the disk may be failing)
      return "See which checkpoints are complete before resuming."
    if last is None:
      return "No checkpoint is complete: a new run starts from step 0."
    return (
        f"The last complete checkpoint is step {last}: a resume starts there."
    )


def _ranges(steps: list[int]) -> str:
  """[1, 2, 3, 7] -> "1-3, 7"."""
  out, start = [], steps[0]
  for prev, cur in zip(steps, [*steps[1:], None], strict=True):
    if cur != prev + 1:
      out.append(f"{start}-{prev}" if prev > start else str(start))
      start = cur
  return ", ".join(out)
