"""`linen-moe generate`: train the reference decoder briefly (or take a fresh
state), convert its expert weights for serving, and decode greedily with the
KV cache, float and converted side by side."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import decoding
from linen_moe import serving
from linen_moe import sharding
from linen_moe._src.config.files import load_model_config
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import SERVING_QUANTIZATIONS
from linen_moe._src.layer.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.models.decoder import Decoder
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe.training import init_train_state
from linen_moe.training import make_train_step


@dataclasses.dataclass(frozen=True)
class DecodeRun:
  """One model's timed greedy decoding.

  Attributes:
    name: "float" or the serving mode.
    expert_bytes: bytes of its expert kernels and their scales.
    prefill_s: best wall time of the prefill (compiled, warm).
    decode_s: best wall time of the `new_tokens - 1` decode steps.
    tokens: <int32>[B, new_tokens], the generated tokens.
  """

  name: str
  expert_bytes: int
  prefill_s: float
  decode_s: float
  tokens: np.ndarray

  @property
  def decode_tokens_per_s(self) -> float:
    b, n = self.tokens.shape
    return b * (n - 1) / self.decode_s


def trained_variables(
    config: ModelConfig, steps: int, batch_size: int, seed: int
) -> tuple[dict, float | None]:
  """The decoder's variables after `steps` Linen training steps in the
  config's quantization mode (a fresh init for 0), and the last loss."""
  data = MarkovData(config.vocab_size)
  batches = data.batches(batch_size, 32, seed=seed + 1)
  tokens = jnp.asarray(next(batches))
  rng = jax.random.key(seed)
  model = Decoder(config)
  optimizer = default_optimizer()
  state = init_train_state(model, optimizer, tokens, rng)
  step = jax.jit(make_train_step(model, optimizer), donate_argnums=0)
  loss = None
  for i in range(steps):
    state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
    tokens = jnp.asarray(next(batches))
    loss = float(metrics["cross_entropy"])
  variables = {"params": state.params}
  if state.fp8_state:
    variables[OVERWRITE_WITH_GRADIENT] = state.fp8_state
  return variables, loss


def _decode_once(config, variables, prompt, new_tokens):
  """(prefill seconds, decode seconds, tokens [B, new_tokens])."""
  b, p = prompt.shape
  cache = decoding.init_cache(config, b, p + new_tokens)
  start = time.perf_counter()
  token, _, cache = decoding.prefill(config, variables, cache, prompt)
  token.block_until_ready()
  prefilled = time.perf_counter()
  out = [token]
  for _ in range(new_tokens - 1):
    token, _, cache = decoding.decode_step(config, variables, cache, token)
    out.append(token)
  token.block_until_ready()
  done = time.perf_counter()
  return prefilled - start, done - prefilled, np.stack(out, axis=1)


def timed_decode(
    name: str,
    config: ModelConfig,
    variables: dict,
    prompt: jax.Array,
    new_tokens: int,
    repeats: int,
) -> DecodeRun:
  """Greedy decoding of `new_tokens` after `prompt`, timed warm (a first run
  compiles and is not counted); the best of `repeats` runs."""
  _decode_once(config, variables, prompt, new_tokens)
  runs = [
      _decode_once(config, variables, prompt, new_tokens)
      for _ in range(repeats)
  ]
  return DecodeRun(
      name=name,
      expert_bytes=serving.expert_weight_bytes(variables),
      prefill_s=min(r[0] for r in runs),
      decode_s=min(r[1] for r in runs),
      tokens=runs[-1][2],
  )


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  config: ModelConfig
  mode: str
  train_steps: int
  train_loss: float | None
  runs: tuple[DecodeRun, DecodeRun]  # float, converted


def generate(
    config: str,
    overrides: dict,
    *,
    quantization: str,
    train_steps: int,
    batch_size: int,
    prompt_len: int,
    new_tokens: int,
    seed: int = 0,
    repeats: int = 3,
) -> GenerateResult:
  """Trains (in `quantization`'s training mode, so fp8 learns its scales) or
  initialises the decoder, converts it with `serving.quantize_weights`, and
  decodes the same prompts with the float weights and the converted ones."""
  for name, value, least in (
      ("train_steps", train_steps, 0),
      ("batch_size", batch_size, 1),
      ("prompt_len", prompt_len, 1),
      ("new_tokens", new_tokens, 2),
      ("repeats", repeats, 1),
  ):
    if value < least:
      raise ValueError(f"{name}={value} must be >= {least}.")
  if quantization not in SERVING_QUANTIZATIONS:
    raise ValueError(
        f"--quantization={quantization!r}: serving converts to one of "
        f"{SERVING_QUANTIZATIONS}."
    )
  cfg = load_model_config(config, quantization=quantization, **overrides)
  variables, loss = trained_variables(cfg, train_steps, 16, seed)
  serve_config, served = serving.quantize_weights(cfg, variables)
  float_config = cfg.replace(quantization="none")
  float_variables = {"params": sharding.unbox(variables["params"])}
  data = MarkovData(cfg.vocab_size)
  prompt = jnp.asarray(next(data.batches(batch_size, prompt_len, seed + 2)))
  runs = (
      timed_decode(
          "float", float_config, float_variables, prompt, new_tokens, repeats
      ),
      timed_decode(
          quantization, serve_config, served, prompt, new_tokens, repeats
      ),
  )
  return GenerateResult(cfg, quantization, train_steps, loss, runs)


def format_report(result: GenerateResult) -> str:
  """The header and the float-vs-converted table."""
  cfg = result.config
  float_run, served = result.runs
  b, n = float_run.tokens.shape
  trained = (
      f"trained {result.train_steps} steps in {result.mode} (last loss "
      f"{result.train_loss:.3f})"
      if result.train_steps
      else "fresh init (untrained)"
  )
  lines = [
      (
          f"{cfg.moe.path} path, {'scanned' if cfg.scan_layers else 'unrolled'}"
          f" layers, {trained}; batch {b}, {n} new tokens, backend"
          f" {jax.default_backend()}"
      ),
      (
          f"{'weights':<10} {'expert bytes':>14} {'ratio':>6}"
          f" {'prefill ms':>11} {'decode tok/s':>13} {'same tokens':>12}"
      ),
  ]
  for run in result.runs:
    same = float(np.mean(run.tokens == float_run.tokens))
    lines.append(
        f"{run.name:<10} {run.expert_bytes:>14,} "
        f"{run.expert_bytes / float_run.expert_bytes:>6.3f} "
        f"{run.prefill_s * 1e3:>11.2f} {run.decode_tokens_per_s:>13.1f} "
        f"{same:>12.1%}"
    )
  if jax.default_backend() == "cpu":
    lines.append(
        "(XLA:CPU converts s8/f8 operands up before its dots: on a CPU the "
        "saving is memory, not speed.)"
    )
  return "\n".join(lines)
