"""The main job: train the reference decoder on synthetic Markov data."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import tqdm

from linen_moe import checkpoint
from linen_moe import distributed
from linen_moe import sharding
from linen_moe.config import load_model_config
from linen_moe.decoder import Decoder
from linen_moe.training import MarkovData
from linen_moe.training import ShardedTraining
from linen_moe.training import default_optimizer
from linen_moe_cli.frontends import frontend as get_frontend

METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """The cross-entropy of each step this call ran (steps `start_step + 1`
  onwards; none when the run was already at its `--steps`)."""

  losses: list[float]
  best_loss: float
  start_step: int = 0

  @property
  def first_loss(self) -> float:
    return self.losses[0]

  @property
  def final_loss(self) -> float:
    """Mean of the last 10 steps' losses (less noisy than the last one)."""
    tail = self.losses[-10:]
    return sum(tail) / len(tail)


def train(
    config: str,
    overrides: dict,
    *,
    steps: int,
    batch_size: int = 16,
    seq_len: int = 32,
    learning_rate: float = 1e-2,
    grad_accum: int = 1,
    seed: int = 0,
    progress: bool = True,
    frontend: str = "linen",
    mesh: str | None = None,
    checkpoint_dir: str | None = None,
    save_every: int | None = None,
    keep: int = 3,
    fresh_fp8_state: bool = False,
    log: Callable[[str], None] = print,
) -> TrainResult:
  """Trains the reference decoder in `frontend` ("linen" or "nnx") up to
  step `steps`; returns the per-step losses.

  With `mesh` (e.g. "data=2,expert=4", see `sharding.make_mesh`) the state is
  sharded at initialisation and every step runs on that mesh. One of several
  processes (`jax.distributed`) trains on a mesh over every process's
  devices (default: "data=<global device count>"); each process generates
  the same global batches from `seed` and places only its own shards, and
  only process 0 shows the progress bar and writes the metrics. Step i (from
  0) trains on batch i of the data stream `seed + 1` with the key
  `fold_in(key(seed), i)`, so a run is a function of its step.

  With `checkpoint_dir` the run resumes from the latest checkpoint there (in
  any front end, layer mode or mesh), saves every `save_every` steps and
  always its last, keeps the latest `keep`, and appends one JSON line per
  step to `checkpoint_dir/metrics.jsonl`. `fresh_fp8_state` allows resuming
  a checkpoint whose fp8 state does not fit the model (see
  `checkpoint.Checkpoints.restore`).
  """
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1.")
  if save_every is not None and checkpoint_dir is None:
    raise ValueError("save_every needs a checkpoint_dir.")
  if mesh is None and jax.process_count() > 1:
    mesh = f"data={jax.device_count()}"
  device_mesh = None if mesh is None else sharding.make_mesh(mesh)
  cfg = load_model_config(config, **overrides)
  data = MarkovData(cfg.vocab_size)
  data_seed = seed + 1
  fe = get_frontend(frontend)
  optimizer = default_optimizer(learning_rate)
  rng = jax.random.key(seed)
  run, feed = None, jnp.asarray
  if device_mesh is not None:
    run = sharded_training(frontend, cfg, optimizer, device_mesh, grad_accum)
    tokens_sharding = run.token_sharding()
    feed = lambda batch: distributed.global_array(  # noqa: E731
        batch.shape, tokens_sharding, batch
    )
  first = feed(data.batch(0, batch_size, seq_len, data_seed))
  ckpts = None
  if checkpoint_dir is not None:
    ckpts = checkpoint.Checkpoints(
        checkpoint_dir, save_every=save_every or steps, keep=keep
    )
  try:
    start, state = 0, None
    latest = None if ckpts is None else ckpts.latest_step()
    if latest is not None and latest >= steps:
      log(
          f"{ckpts.directory} is already at step {latest} (--steps "
          f"{steps}); nothing to train."
      )
      return TrainResult([], data.best_loss, latest)
    if latest is not None:
      start, state, rng = _resume(
          ckpts, fe, run, cfg, optimizer, first, seed, fresh_fp8_state, log
      )
    if state is None:
      state = (
          run.init(first, rng) if run else fe.init(cfg, optimizer, first, rng)
      )
    if run is None:
      step_fn = jax.jit(
          fe.make_step(cfg, optimizer, grad_accum), donate_argnums=0
      )
    else:
      step_fn = run.step
    meta = {
        "model_config": checkpoint.config_dict(cfg),
        "rng": checkpoint.rng_to_json(rng),
        "data": {"kind": "markov", "seed": data_seed},
        "run": {
            "config": config,
            "frontend": frontend,
            "mesh": mesh,
            "seed": seed,
        },
    }
    metrics_path = None
    main_process = distributed.is_main_process()
    if ckpts is not None and main_process:
      metrics_path = os.path.join(ckpts.directory, METRICS_FILE)
      _truncate_metrics(metrics_path, start)
    losses = []
    show = progress and main_process
    bar = tqdm.trange(start, steps, disable=not show, desc="train")
    for i in bar:
      tokens = feed(data.batch(i, batch_size, seq_len, data_seed))
      state, metrics = step_fn(state, tokens, jax.random.fold_in(rng, i))
      record = {"step": i + 1, **{k: float(v) for k, v in metrics.items()}}
      losses.append(record["cross_entropy"])
      bar.set_postfix(loss=f"{losses[-1]:.3f}", best=f"{data.best_loss:.3f}")
      if metrics_path is not None:
        with open(metrics_path, "a", encoding="utf-8") as f:
          f.write(json.dumps(record) + "\n")
      done = i + 1
      if ckpts is not None and (
          done % (save_every or steps) == 0 or done == steps
      ):
        meta["data"]["position"] = done
        ckpts.save(done, fe.checkpoint_tree(state), meta, force=True)
    return TrainResult(losses, data.best_loss, start)
  finally:
    if ckpts is not None:
      ckpts.close()  # waits for the last save


def _resume(ckpts, fe, run, cfg, optimizer, first, seed, fresh_fp8_state, log):
  """(step, state, rng) of the latest checkpoint in `ckpts`, restored into
  `fe`'s state (on `run`'s mesh, if any)."""
  meta = ckpts.meta()
  saved_seed = meta.get("run", {}).get("seed")
  if saved_seed != seed:
    raise ValueError(
        f"--seed {seed} differs from the seed {saved_seed} of the run in "
        f"{ckpts.directory}; resume with --seed {saved_seed} or use a new "
        "--checkpoint-dir."
    )
  rng = checkpoint.rng_from_json(meta["rng"])
  if fresh_fp8_state:  # a fresh fp8 state needs initial values
    target = (
        run.init(first, rng) if run else fe.init(cfg, optimizer, first, rng)
    )
  elif run is not None:
    target = run.abstract_state(first, rng)
  else:
    target = jax.eval_shape(
        lambda t, r: fe.init(cfg, optimizer, t, r), first, rng
    )
  restored = ckpts.restore(
      fe.checkpoint_tree(target), config=cfg, fresh_fp8_state=fresh_fp8_state
  )
  state = fe.from_checkpoint_tree(restored.tree, target)
  note = " with fresh fp8 state" if restored.fresh_fp8_state else ""
  log(f"resumed from step {restored.step}{note} ({ckpts.directory})")
  return restored.step, state, rng


def _truncate_metrics(path: str, step: int) -> None:
  """Drops the lines of steps after `step` (written after the checkpoint a
  run resumes from), so a resumed run appends exactly once per step."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  # A line without its newline was torn by a killed run.
  kept = [
      line
      for line in lines
      if line.endswith("\n") and json.loads(line)["step"] <= step
  ]
  if kept != lines:
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(kept)


def sharded_training(frontend: str, cfg, optimizer, mesh, grad_accum: int = 1):
  """The sharded init and step of `frontend`'s decoder on `mesh`."""
  if frontend == "nnx":
    import nnx_adapter  # noqa: PLC0415 (optional front end)

    return nnx_adapter.ShardedNNXTraining(
        cfg, optimizer, mesh, grad_accum=grad_accum
    )
  return ShardedTraining(Decoder(cfg), optimizer, mesh, grad_accum=grad_accum)
