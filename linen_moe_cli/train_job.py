"""The main job: train the reference decoder on synthetic Markov data."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import tqdm

from linen_moe import distributed
from linen_moe import sharding
from linen_moe.config import load_model_config
from linen_moe.decoder import Decoder
from linen_moe.tokens import validate_tokens
from linen_moe.training import MarkovData
from linen_moe.training import ShardedTraining
from linen_moe.training import default_optimizer
from linen_moe_cli import options
from linen_moe_cli.frontends import frontend as get_frontend


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """Per-step cross-entropy (NaN where the step was skipped), the best
  achievable loss, and how many steps were skipped."""

  losses: list[float]
  best_loss: float
  skipped_steps: int = 0

  @property
  def first_loss(self) -> float:
    return next((x for x in self.losses if math.isfinite(x)), math.nan)

  @property
  def final_loss(self) -> float:
    """Mean of the last 10 steps' finite losses (less noisy than the last)."""
    tail = [x for x in self.losses[-10:] if math.isfinite(x)]
    return sum(tail) / len(tail) if tail else math.nan


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
  only process 0 shows the progress bar.

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
  )
  if mesh is None and jax.process_count() > 1:
    mesh = f"data={jax.device_count()}"
  device_mesh = None if mesh is None else sharding.make_mesh(mesh)
  cfg = load_model_config(config, **overrides)
  data = MarkovData(cfg.vocab_size)
  batches = (
      validate_tokens(b, cfg.vocab_size, name="batch")
      for b in data.batches(batch_size, seq_len, seed=seed + 1)
  )
  fe = get_frontend(frontend)
  optimizer = default_optimizer(learning_rate)
  rng = jax.random.key(seed)
  if device_mesh is None:
    feed = jnp.asarray
    first = feed(next(batches))
    state = fe.init(cfg, optimizer, first, rng)
    step = jax.jit(fe.make_step(cfg, optimizer, grad_accum), donate_argnums=0)
  else:
    run = sharded_training(frontend, cfg, optimizer, device_mesh, grad_accum)
    tokens_sharding = run.token_sharding()
    feed = lambda batch: distributed.global_array(  # noqa: E731
        batch.shape, tokens_sharding, batch
    )
    first = feed(next(batches))
    state, step = run.init(first, rng), run.step
  losses, skipped, in_a_row = [], 0, 0
  show = progress and distributed.is_main_process()
  bar = tqdm.trange(steps, disable=not show, desc="train")
  for i in bar:
    tokens = first if i == 0 else feed(next(batches))
    state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
    loss = float(metrics["cross_entropy"])
    losses.append(loss)
    in_a_row = in_a_row + 1 if int(metrics["skipped"]) else 0
    skipped += in_a_row > 0
    if in_a_row >= max_consecutive_skips:
      raise options.RunStopped(
          f"stopped at step {i + 1} of {steps}: the last {in_a_row} steps "
          f"({i + 2 - in_a_row} to {i + 1}) were all skipped for a non-finite "
          f"loss or gradient (--max-consecutive-skips {max_consecutive_skips}"
          f"; {skipped} skipped in all). The run is not recovering: lower "
          "--learning-rate, or check the data."
      )
    bar.set_postfix(
        loss=f"{loss:.3f}", best=f"{data.best_loss:.3f}", skipped=skipped
    )
  return TrainResult(losses, data.best_loss, skipped)


def sharded_training(frontend: str, cfg, optimizer, mesh, grad_accum: int = 1):
  """The sharded init and step of `frontend`'s decoder on `mesh`."""
  if frontend == "nnx":
    import nnx_adapter  # noqa: PLC0415 (optional front end)

    return nnx_adapter.ShardedNNXTraining(
        cfg, optimizer, mesh, grad_accum=grad_accum
    )
  return ShardedTraining(Decoder(cfg), optimizer, mesh, grad_accum=grad_accum)
