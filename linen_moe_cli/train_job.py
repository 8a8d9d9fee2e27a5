"""The main job: train the reference decoder on synthetic Markov data."""

from __future__ import annotations

import collections
from collections.abc import Callable
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from linen_moe import checkpoint
from linen_moe import distributed
from linen_moe import sharding
from linen_moe._src.config import load_model_config
from linen_moe.tokens import validate_tokens
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe_cli import options
from linen_moe_cli.checkpointing import RunCheckpoints
from linen_moe_cli.frontends import frontend as get_frontend
from linen_moe_cli.frontends import sharded_training
from linen_moe_cli.options import TrainOptions

# Steps over which the final loss and expert loads are averaged.
TAIL_STEPS = 10


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """Per-step cross-entropy (NaN where the step was skipped) of the steps
  this call ran (`start_step + 1` onwards; none when a resumed run was already
  at its `steps`), the best achievable loss, how many steps were skipped, and
  <float32>[L, E] each layer's share of routed assignments per expert
  averaged over the last `TAIL_STEPS` steps."""

  losses: list[float]
  best_loss: float
  skipped_steps: int = 0
  expert_load: np.ndarray | None = None
  start_step: int = 0

  @property
  def first_loss(self) -> float:
    return next((x for x in self.losses if math.isfinite(x)), math.nan)

  @property
  def final_loss(self) -> float:
    """Mean of the last 10 steps' finite losses (less noisy than the last)."""
    tail = [x for x in self.losses[-TAIL_STEPS:] if math.isfinite(x)]
    return sum(tail) / len(tail) if tail else math.nan

  @property
  def load_ratio(self) -> float:
    """Max / min expert load of the most unbalanced layer (1 = balanced; inf
    when an expert got nothing), from `expert_load`."""
    ratios = self.expert_load.max(axis=-1) / self.expert_load.min(axis=-1)
    return float(np.max(ratios))


@dataclasses.dataclass
class _Setup:
  """What a run builds before its first step (no compile yet)."""

  cfg: Any  # ModelConfig
  data: MarkovData
  fe: Any  # TrainingFrontend
  optimizer: Any
  mesh: str | None
  run: Any  # sharded training, or None on one device
  feed: Callable[[np.ndarray], jax.Array]


def _set_up(opts: TrainOptions) -> _Setup:
  mesh = opts.mesh
  if mesh is None and jax.process_count() > 1:
    mesh = f"data={jax.device_count()}"
  device_mesh = None if mesh is None else sharding.make_mesh(mesh)
  cfg = load_model_config(opts.config, **opts.overrides)
  optimizer = default_optimizer(opts.learning_rate)
  run, feed = None, jnp.asarray
  if device_mesh is not None:
    run = sharded_training(
        opts.frontend, cfg, optimizer, device_mesh, opts.grad_accum
    )
    tokens_sharding = run.token_sharding()
    feed = lambda batch: distributed.global_array(  # noqa: E731
        batch.shape, tokens_sharding, batch
    )
  return _Setup(
      cfg=cfg,
      data=MarkovData(cfg.vocab_size),
      fe=get_frontend(opts.frontend),
      optimizer=optimizer,
      mesh=mesh,
      run=run,
      feed=feed,
  )


def train(opts: TrainOptions, *, log: Callable[[str], None] = print):
  """Trains the reference decoder as `opts` says; returns a `TrainResult`.

  A batch holding an id outside [0, vocab_size) is a `ValueError`
  (`linen_moe.tokens.validate_tokens`) before its step.

  With `opts.mesh` (e.g. "data=2,expert=4", see `sharding.make_mesh`) the
  state is sharded at initialisation and every step runs on that mesh. One
  of several processes (`jax.distributed`) trains on a mesh over every
  process's devices (default: "data=<global device count>"); each process
  generates the same global batches from the seed and places only its own
  shards, and only process 0 shows the progress bar. Step i (from 0) trains
  on batch i of the data stream `seed + 1` with the key
  `fold_in(key(seed), i)`, so a run is a function of its step.

  With `opts.checkpoint_dir` the run resumes from the latest checkpoint
  there (in any front end, layer mode or mesh), saves every `save_every`
  steps and always its last, keeps the latest `keep`, and appends one JSON
  line per step to `checkpoint_dir/metrics.jsonl`
  (`checkpointing.RunCheckpoints`).

  A step with a non-finite loss or gradient is skipped (the state stays as
  it was; `linen_moe.training.skip`) and counted; after
  `max_consecutive_skips` skipped steps in a row the run stops with
  `options.RunStopped`.
  """
  job = _set_up(opts)
  ckpts = None
  if opts.checkpoint_dir is not None:
    ckpts = RunCheckpoints(
        opts.checkpoint_dir,
        steps=opts.steps,
        save_every=opts.save_every,
        keep=opts.keep,
        log=log,
    )
  try:
    latest = None if ckpts is None else ckpts.latest_step()
    if latest is not None and latest >= opts.steps:
      log(
          f"{opts.checkpoint_dir} is already at step {latest} (--steps "
          f"{opts.steps}); nothing to train."
      )
      return TrainResult([], job.data.best_loss, start_step=latest)
    return _train_from(opts, job, ckpts, latest)
  finally:
    if ckpts is not None:
      ckpts.close()  # waits for the last save


def _train_from(opts: TrainOptions, job: _Setup, ckpts, latest: int | None):
  """Restores checkpoint `latest` (None: initialises) and trains to the
  end."""
  fe, run, cfg = job.fe, job.run, job.cfg
  start = latest or 0
  data_seed = opts.seed + 1
  rng = jax.random.key(opts.seed)
  batches = (  # batch i is a function of (data_seed, i): resumable
      validate_tokens(b, cfg.vocab_size, name="batch")
      for b in job.data.batches(
          opts.batch_size, opts.seq_len, data_seed, start=start
      )
  )
  first = job.feed(next(batches))
  state = None
  if latest is not None:
    start, state, rng = ckpts.resume(
        fe, run, cfg, job.optimizer, first, opts.seed, opts.fresh_fp8_state
    )
  if state is None:
    state = (
        run.init(first, rng) if run else fe.init(cfg, job.optimizer, first, rng)
    )
  if run is None:
    step = jax.jit(
        fe.make_step(cfg, job.optimizer, opts.grad_accum), donate_argnums=0
    )
  else:
    step = run.step
  if ckpts is not None:
    ckpts.begin(
        start,
        {
            "model_config": checkpoint.config_dict(cfg),
            "rng": checkpoint.rng_to_json(rng),
            "data": {"kind": "markov", "seed": data_seed},
            "run": {
                "config": opts.config,
                "frontend": opts.frontend,
                "mesh": job.mesh,
                "seed": opts.seed,
            },
        },
    )
  losses, skipped, in_a_row = [], 0, 0
  loads = collections.deque(maxlen=TAIL_STEPS)
  show = opts.progress and distributed.is_main_process()
  bar = tqdm.trange(start, opts.steps, disable=not show, desc="train")
  for i in bar:
    tokens = first if i == start else job.feed(next(batches))
    state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
    loss = float(metrics["cross_entropy"])
    losses.append(loss)
    loads.append(metrics["expert_load"])
    if ckpts is not None:
      ckpts.after_step(i + 1, metrics, fe.checkpoint_tree, state)
    in_a_row = in_a_row + 1 if int(metrics["skipped"]) else 0
    skipped += in_a_row > 0
    if in_a_row >= opts.max_consecutive_skips:
      raise options.RunStopped(
          f"stopped at step {i + 1} of {opts.steps}: the last {in_a_row} "
          f"steps ({i + 2 - in_a_row} to {i + 1}) were all skipped for a "
          "non-finite loss or gradient (--max-consecutive-skips "
          f"{opts.max_consecutive_skips}; {skipped} skipped in all). The run "
          "is not recovering: lower --learning-rate, or check the data."
      )
    bar.set_postfix(
        loss=f"{loss:.3f}", best=f"{job.data.best_loss:.3f}", skipped=skipped
    )
  return TrainResult(
      losses,
      job.data.best_loss,
      skipped,
      expert_load=np.mean(jax.device_get(list(loads)), axis=0),
      start_step=start,
  )
