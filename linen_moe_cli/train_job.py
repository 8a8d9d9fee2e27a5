"""The main job: train the reference decoder on synthetic Markov data."""

from __future__ import annotations

import collections
from collections.abc import Callable
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from linen_moe import checkpoint
from linen_moe import distributed
from linen_moe import sharding
from linen_moe._src.config import load_model_config
from linen_moe._src.models.decoder import Decoder
from linen_moe.tokens import validate_tokens
from linen_moe.training import MarkovData
from linen_moe.training import ShardedTraining
from linen_moe.training import default_optimizer
from linen_moe_cli import options
from linen_moe_cli.checkpointing import RunCheckpoints
from linen_moe_cli.frontends import frontend as get_frontend

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
    max_consecutive_skips: int = 10,
    checkpoint_dir: str | None = None,
    save_every: int | None = None,
    keep: int = 3,
    fresh_fp8_state: bool = False,
    log: Callable[[str], None] = print,
) -> TrainResult:
  """Trains the reference decoder in `frontend` ("linen" or "nnx"); returns
  the per-step losses. Bad options are a `ValueError` before any work
  (`options.check_train_options`), and so is a batch holding an id outside
  [0, vocab_size) (`linen_moe.tokens.validate_tokens`), before its step.

  With `mesh` (e.g. "data=2,expert=4", see `sharding.make_mesh`) the state is
  sharded at initialisation and every step runs on that mesh. One of several
  processes (`jax.distributed`) trains on a mesh over every process's
  devices (default: "data=<global device count>"); each process generates
  the same global batches from `seed` and places only its own shards, and
  only process 0 shows the progress bar. Step i (from 0) trains on batch i
  of the data stream `seed + 1` with the key `fold_in(key(seed), i)`, so a
  run is a function of its step.

  With `checkpoint_dir` the run resumes from the latest checkpoint there (in
  any front end, layer mode or mesh), saves every `save_every` steps and
  always its last, keeps the latest `keep`, and appends one JSON line per
  step to `checkpoint_dir/metrics.jsonl` (`checkpointing.RunCheckpoints`).
  `fresh_fp8_state` allows resuming a checkpoint whose fp8 state does not
  fit the model (see `linen_moe.checkpoint.Checkpoints.restore`).

  A step with a non-finite loss or gradient is skipped (the state stays as it
  was; `linen_moe.training.skip`) and counted; after `max_consecutive_skips`
  skipped steps in a row the run stops with `options.RunStopped`.
  """
  options.check_train_options(
      steps=steps,
      batch_size=batch_size,
      seq_len=seq_len,
      learning_rate=learning_rate,
      grad_accum=grad_accum,
      max_consecutive_skips=max_consecutive_skips,
      checkpoint_dir=checkpoint_dir,
      save_every=save_every,
      keep=keep,
  )
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
  ckpts = None
  if checkpoint_dir is not None:
    ckpts = RunCheckpoints(
        checkpoint_dir, steps=steps, save_every=save_every, keep=keep, log=log
    )
  try:
    latest = None if ckpts is None else ckpts.latest_step()
    if latest is not None and latest >= steps:
      log(
          f"{checkpoint_dir} is already at step {latest} (--steps {steps}); "
          "nothing to train."
      )
      return TrainResult([], data.best_loss, start_step=latest)
    start, state = latest or 0, None
    batches = (  # batch i is a function of (data_seed, i): resumable
        validate_tokens(b, cfg.vocab_size, name="batch")
        for b in data.batches(batch_size, seq_len, data_seed, start=start)
    )
    first = feed(next(batches))
    if latest is not None:
      start, state, rng = ckpts.resume(
          fe, run, cfg, optimizer, first, seed, fresh_fp8_state
      )
    if state is None:
      state = (
          run.init(first, rng) if run else fe.init(cfg, optimizer, first, rng)
      )
    if run is None:
      step = jax.jit(fe.make_step(cfg, optimizer, grad_accum), donate_argnums=0)
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
                  "config": config,
                  "frontend": frontend,
                  "mesh": mesh,
                  "seed": seed,
              },
          },
      )
    losses, skipped, in_a_row = [], 0, 0
    loads = collections.deque(maxlen=TAIL_STEPS)
    show = progress and distributed.is_main_process()
    bar = tqdm.trange(start, steps, disable=not show, desc="train")
    for i in bar:
      tokens = first if i == start else feed(next(batches))
      state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
      loss = float(metrics["cross_entropy"])
      losses.append(loss)
      loads.append(metrics["expert_load"])
      if ckpts is not None:
        ckpts.after_step(i + 1, metrics, fe.checkpoint_tree, state)
      in_a_row = in_a_row + 1 if int(metrics["skipped"]) else 0
      skipped += in_a_row > 0
      if in_a_row >= max_consecutive_skips:
        raise options.RunStopped(
            f"stopped at step {i + 1} of {steps}: the last {in_a_row} steps "
            f"({i + 2 - in_a_row} to {i + 1}) were all skipped for a "
            "non-finite loss or gradient (--max-consecutive-skips "
            f"{max_consecutive_skips}; {skipped} skipped in all). The run is "
            "not recovering: lower --learning-rate, or check the data."
        )
      bar.set_postfix(
          loss=f"{loss:.3f}", best=f"{data.best_loss:.3f}", skipped=skipped
      )
  finally:
    if ckpts is not None:
      ckpts.close()  # waits for the last save
  return TrainResult(
      losses,
      data.best_loss,
      skipped,
      expert_load=np.mean(jax.device_get(list(loads)), axis=0),
      start_step=start,
  )


def sharded_training(frontend: str, cfg, optimizer, mesh, grad_accum: int = 1):
  """The sharded init and step of `frontend`'s decoder on `mesh`."""
  if frontend == "nnx":
    import nnx_adapter  # noqa: PLC0415 (optional front end)

    return nnx_adapter.ShardedNNXTraining(
        cfg, optimizer, mesh, grad_accum=grad_accum
    )
  return ShardedTraining(Decoder(cfg), optimizer, mesh, grad_accum=grad_accum)
