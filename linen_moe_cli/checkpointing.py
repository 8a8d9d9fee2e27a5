"""The checkpoints and per-step metrics of one `linen-moe train` run.

A run with `--checkpoint-dir DIR` resumes from the latest checkpoint in DIR
(in any front end, layer mode or mesh: `linen_moe.checkpoint` restores into
the run's own state), saves every `--save-every` steps and always its last,
and appends one JSON object per step to `DIR/metrics.jsonl`. Lines written
after the checkpoint a run resumes from (a killed run's) are dropped first,
so the file holds each step once.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import os
from typing import Any

import jax
import numpy as np

from linen_moe import checkpoint
from linen_moe import distributed

METRICS_FILE = "metrics.jsonl"


def _json_value(x: Any) -> Any:
  value = np.asarray(jax.device_get(x))
  return value.item() if value.ndim == 0 else value.tolist()


class RunCheckpoints:
  """`checkpoint.Checkpoints` of a training run, its saving policy and its
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
    self.steps, self.save_every, self.log = steps, save_every or steps, log
    self.checkpoints = checkpoint.Checkpoints(
        directory, save_every=self.save_every, keep=keep
    )
    self.metrics_path = os.path.join(self.checkpoints.directory, METRICS_FILE)
    self.main_process = distributed.is_main_process()
    self.meta: dict = {}

  def close(self) -> None:
    """Waits for the last save to be on disk."""
    self.checkpoints.close()

  def latest_step(self) -> int | None:
    return self.checkpoints.latest_step()

  def resume(self, fe, run, cfg, optimizer, first, seed, fresh_fp8_state):
    """(step, state, rng) of the latest checkpoint, restored into `fe`'s
    state (sharded as `run`'s, if any) straight from disk; an abstract target
    unless a fresh fp8 state needs initial values."""
    meta = self.checkpoints.meta()
    saved_seed = meta.get("run", {}).get("seed")
    if saved_seed != seed:
      raise ValueError(
          f"--seed {seed} differs from the seed {saved_seed} of the run in "
          f"{self.checkpoints.directory}; resume with --seed {saved_seed} or "
          "use a new --checkpoint-dir."
      )
    rng = checkpoint.rng_from_json(meta["rng"])
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
    restored = self.checkpoints.restore(
        fe.checkpoint_tree(target), config=cfg, fresh_fp8_state=fresh_fp8_state
    )
    state = fe.from_checkpoint_tree(restored.tree, target)
    note = " with fresh fp8 state" if restored.fresh_fp8_state else ""
    self.log(
        f"resumed from step {restored.step}{note} "
        f"({self.checkpoints.directory})"
    )
    return restored.step, state, rng

  def begin(self, start: int, meta: dict) -> None:
    """Starts recording at step `start` (0 or the resumed step); `meta` (the
    model config, the RNG, the data and run settings) goes with every
    checkpoint."""
    self.meta = meta
    if not self.main_process or not os.path.exists(self.metrics_path):
      return
    with open(self.metrics_path, encoding="utf-8") as f:
      lines = f.readlines()
    # A line without its newline was torn by a killed run.
    kept = [
        line
        for line in lines
        if line.endswith("\n") and json.loads(line)["step"] <= start
    ]
    if kept != lines:
      with open(self.metrics_path, "w", encoding="utf-8") as f:
        f.writelines(kept)

  def after_step(self, done: int, metrics: dict, tree_of, state) -> None:
    """Appends step `done`'s metrics; saves `tree_of(state)` when due."""
    if self.main_process:
      record = {"step": done, **{k: _json_value(v) for k, v in metrics.items()}}
      with open(self.metrics_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if done % self.save_every == 0 or done == self.steps:
      meta = {**self.meta, "data": {**self.meta["data"], "position": done}}
      self.checkpoints.save(done, tree_of(state), meta, force=True)
