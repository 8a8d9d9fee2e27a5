"""The main job: train the reference decoder on synthetic Markov data."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import tqdm

from linen_moe import train as train_lib
from linen_moe.config import ModelConfig
from linen_moe.config import load_model_config
from linen_moe.data import MarkovData
from linen_moe.decoder import Decoder
import nnx_adapter

FRONTENDS = ("linen", "nnx")


@dataclasses.dataclass(frozen=True)
class Training:
  """One front end's training functions for a `ModelConfig`.

  Attributes:
    init: `init(tokens, rng) -> state`; `tokens` <int32>[B, S] sample batch.
    step: jitted `step(state, tokens, rng) -> (state, metrics)`; `state.params`
      and `state.fp8_state` are Linen-layout trees in both front ends.
  """

  init: Callable
  step: Callable


def make_training(
    frontend: str,
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    grad_accum: int = 1,
    donate: bool = True,
) -> Training:
  """The reference decoder of `config` and its train step, in Linen
  (`linen_moe.train`) or NNX (`nnx_adapter`)."""
  if frontend == "linen":
    model = Decoder(config)
    init = functools.partial(train_lib.init_train_state, model, optimizer)
    step = train_lib.make_train_step(model, optimizer, grad_accum)
  elif frontend == "nnx":
    init = functools.partial(nnx_adapter.init_train_state, config, optimizer)
    step = nnx_adapter.make_train_step(grad_accum)
  else:
    raise ValueError(f"Unknown frontend {frontend!r}; allowed: {FRONTENDS}.")
  return Training(init, jax.jit(step, donate_argnums=0 if donate else ()))


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
) -> TrainResult:
  """Trains the reference decoder in `frontend`; returns per-step losses."""
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1.")
  cfg = load_model_config(config, **overrides)
  data = MarkovData(cfg.vocab_size)
  batches = data.batches(batch_size, seq_len, seed=seed + 1)
  optimizer = train_lib.default_optimizer(learning_rate)
  training = make_training(frontend, cfg, optimizer, grad_accum)
  rng = jax.random.key(seed)
  first = jnp.asarray(next(batches))
  state = training.init(first, rng)
  losses = []
  bar = tqdm.trange(steps, disable=not progress, desc="train")
  for i in bar:
    tokens = first if i == 0 else jnp.asarray(next(batches))
    state, metrics = training.step(state, tokens, jax.random.fold_in(rng, i))
    loss = float(metrics["cross_entropy"])
    losses.append(loss)
    bar.set_postfix(loss=f"{loss:.3f}", best=f"{data.best_loss:.3f}")
  return TrainResult(losses=losses, best_loss=data.best_loss)
