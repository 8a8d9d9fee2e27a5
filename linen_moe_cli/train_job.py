"""The main job: train the reference decoder on synthetic Markov data."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import tqdm

from linen_moe import sharding
from linen_moe.config import load_model_config
from linen_moe.decoder import Decoder
from linen_moe.training import MarkovData
from linen_moe.training import ShardedTraining
from linen_moe.training import default_optimizer
from linen_moe_cli.frontends import frontend as get_frontend


@dataclasses.dataclass(frozen=True)
class TrainResult:
  losses: list[float]
  best_loss: float

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
) -> TrainResult:
  """Trains the reference decoder in `frontend` ("linen" or "nnx"); returns
  the per-step losses.

  With `mesh` (e.g. "data=2,expert=4", see `sharding.make_mesh`) the state is
  sharded at initialisation and every step runs on that mesh.
  """
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1.")
  device_mesh = None if mesh is None else sharding.make_mesh(mesh)
  cfg = load_model_config(config, **overrides)
  data = MarkovData(cfg.vocab_size)
  batches = data.batches(batch_size, seq_len, seed=seed + 1)
  fe = get_frontend(frontend)
  optimizer = default_optimizer(learning_rate)
  rng = jax.random.key(seed)
  first = jnp.asarray(next(batches))
  if device_mesh is None:
    state = fe.init(cfg, optimizer, first, rng)
    step = jax.jit(fe.make_step(cfg, optimizer, grad_accum), donate_argnums=0)
  else:
    run = sharded_training(frontend, cfg, optimizer, device_mesh, grad_accum)
    state, step = run.init(first, rng), run.step
  losses = []
  bar = tqdm.trange(steps, disable=not progress, desc="train")
  for i in bar:
    tokens = first if i == 0 else jnp.asarray(next(batches))
    state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
    loss = float(metrics["cross_entropy"])
    losses.append(loss)
    bar.set_postfix(loss=f"{loss:.3f}", best=f"{data.best_loss:.3f}")
  return TrainResult(losses=losses, best_loss=data.best_loss)


def sharded_training(frontend: str, cfg, optimizer, mesh, grad_accum: int = 1):
  """The sharded init and step of `frontend`'s decoder on `mesh`."""
  if frontend == "nnx":
    import nnx_adapter  # noqa: PLC0415 (optional front end)

    return nnx_adapter.ShardedNNXTraining(
        cfg, optimizer, mesh, grad_accum=grad_accum
    )
  return ShardedTraining(Decoder(cfg), optimizer, mesh, grad_accum=grad_accum)
