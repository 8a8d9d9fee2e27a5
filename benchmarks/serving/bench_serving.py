"""Quantized serving: bytes of the expert weights, and decode speed.

1. Expert-weight bytes (routed and shared kernels, with their scales) of the
   reference decoder per config, stored as float32, bfloat16, int8, fp8.
   Shapes only: `jax.eval_shape` of `Decoder.init` and of
   `serving.quantize_weights`, so `mixtral_8x7b` allocates nothing.
2. Greedy decoding with the KV cache (`linen_moe.decoding`) of a small
   decoder trained briefly (`--train-steps`, in the serving mode's training
   mode, so fp8 learns its scales), float vs each `--modes` converted
   (int8, fp8, nanoo_fp8): expert bytes, prefill time and decode tokens/s,
   warm, best of `--repeats`, and how many tokens match the float ones.
   (`linen-moe generate` without a checkpoint did this before 0.3.)

  python benchmarks/serving/bench_serving.py
  python benchmarks/serving/bench_serving.py --configs tiny_mixtral \\
      --decode-config tiny_mixtral --modes int8 --batch 8 --new-tokens 64

On a CPU, XLA converts s8 and f8 operands up (to s32 / f16 / f32) before
its dots, so the quantized models run no faster than the float one there:
the saving measured here is memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import linen_moe
from linen_moe import decoding
from linen_moe import frontend
from linen_moe import quantization as serving
from linen_moe import sharding
from linen_moe import training

STORAGE = ("float32", "bfloat16", "int8", "fp8")


def expert_bytes(config_name: str) -> dict[str, int]:
  """{storage: bytes of the expert weights}, from shapes alone."""
  cfg = linen_moe.load_model_config(config_name, quantization="int8")
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  out = {}
  for storage in STORAGE:
    if storage in ("float32", "bfloat16"):
      c = cfg.replace(quantization="none", param_dtype=storage)
      shapes = jax.eval_shape(
          lambda t, c=c: linen_moe.Decoder(c).init(jax.random.key(0), t), tokens
      )
    else:
      c = cfg.replace(quantization=storage)
      float_shapes = jax.eval_shape(
          lambda t: linen_moe.Decoder(cfg).init(jax.random.key(0), t), tokens
      )
      shapes = jax.eval_shape(
          lambda v, c=c: serving.quantize_weights(c, v)[1],
          sharding.unbox(float_shapes),
      )
    out[storage] = serving.expert_weight_bytes(shapes)
  return out


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
    config: linen_moe.ModelConfig, steps: int, batch_size: int, seed: int
) -> tuple[dict, float | None]:
  """The decoder's variables after `steps` Linen training steps in the
  config's quantization mode (a fresh init for 0), and the last loss."""
  data = training.MarkovData(config.vocab_size)
  batches = data.batches(batch_size, 32, seed=seed + 1)
  tokens = jnp.asarray(next(batches))
  rng = jax.random.key(seed)
  model = linen_moe.Decoder(config)
  optimizer = training.default_optimizer()
  state = training.init_train_state(model, optimizer, tokens, rng)
  step = jax.jit(training.make_train_step(model, optimizer), donate_argnums=0)
  loss = None
  for i in range(steps):
    state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
    tokens = jnp.asarray(next(batches))
    loss = float(metrics["cross_entropy"])
  return frontend.variables_of(training.LinenFrontend, state), loss


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
    config: linen_moe.ModelConfig,
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
  config: linen_moe.ModelConfig
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
  initialises the decoder, converts it with `serving.quantize_weights` (a
  mode that stores no weights is the config's ValueError), and decodes the
  same prompts with the float weights and the converted ones."""
  for name, value, least in (
      ("train_steps", train_steps, 0),
      ("batch_size", batch_size, 1),
      ("prompt_len", prompt_len, 1),
      ("new_tokens", new_tokens, 2),
      ("repeats", repeats, 1),
  ):
    if value < least:
      raise ValueError(f"{name}={value} must be >= {least}.")
  cfg = linen_moe.load_model_config(
      config, quantization=quantization, **overrides
  )
  cfg.replace(serving=True)  # a mode that stores no weights fails here
  variables, loss = trained_variables(cfg, train_steps, 16, seed)
  serve_config, served = serving.quantize_weights(cfg, variables)
  float_config = cfg.replace(quantization="none")
  float_variables = {"params": sharding.unbox(variables["params"])}
  data = training.MarkovData(cfg.vocab_size)
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


def _human(n: int) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--configs",
      nargs="+",
      default=["tiny_mixtral", "mixtral_8x7b", "gemma4_26b"],
  )
  parser.add_argument("--decode-config", default="tiny_mixtral")
  parser.add_argument(
      "--modes", nargs="+", default=["int8", "fp8", "nanoo_fp8"]
  )
  parser.add_argument("--train-steps", type=int, default=50)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  print("expert-weight bytes (routed + shared kernels and their scales)")
  print(f"{'config':<16}" + "".join(f"{s:>20}" for s in STORAGE))
  for name in args.configs:
    row = expert_bytes(name)
    cells = "".join(
        f"{_human(row[s])} {row[s] / row['float32']:.2f}x".rjust(20)
        for s in STORAGE
    )
    print(f"{name:<16}{cells}")

  print(
      f"\ngreedy decoding, {args.decode_config}, backend"
      f" {jax.default_backend()}"
  )
  for mode in args.modes:
    result = generate(
        args.decode_config,
        {},
        quantization=mode,
        train_steps=args.train_steps,
        batch_size=args.batch,
        prompt_len=args.prompt,
        new_tokens=args.new_tokens,
        seed=args.seed,
        repeats=args.repeats,
    )
    print(format_report(result))


if __name__ == "__main__":
  main()
