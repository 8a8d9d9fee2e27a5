"""Quantized serving: bytes of the expert weights, and decode speed.

1. Expert-weight bytes (routed and shared kernels, with their scales) of the
   reference decoder per config, stored as float32, bfloat16, int8, fp8.
   Shapes only: `jax.eval_shape` of `Decoder.init` and of
   `serving.quantize_weights`, so `mixtral_8x7b` allocates nothing.
2. Greedy decoding with the KV cache (`linen_moe.decoding`) of a small
   decoder, float vs int8 vs fp8 vs nanoo_fp8 weights: prefill time and
   decode tokens/s, warm, best of `--repeats`.

  PYTHONPATH=. python benchmarks/bench_serving.py
  PYTHONPATH=. python benchmarks/bench_serving.py --configs tiny_mixtral \
      --decode-config tiny_mixtral --batch 8 --new-tokens 64

On a CPU, XLA converts s8 and f8 operands up (to s32 / f16 / f32) before
its dots, so the quantized models run no faster than the float one there:
the saving measured here is memory.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from linen_moe import load_model_config
from linen_moe import serving
from linen_moe._src.models.decoder import Decoder
from linen_moe.sharding import unbox
from linen_moe_cli import generate_job

STORAGE = ("float32", "bfloat16", "int8", "fp8")


def expert_bytes(config_name: str) -> dict[str, int]:
  """{storage: bytes of the expert weights}, from shapes alone."""
  cfg = load_model_config(config_name, quantization="int8")
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  out = {}
  for storage in STORAGE:
    if storage in ("float32", "bfloat16"):
      c = cfg.replace(quantization="none", param_dtype=storage)
      shapes = jax.eval_shape(
          lambda t, c=c: Decoder(c).init(jax.random.key(0), t), tokens
      )
    else:
      c = cfg.replace(quantization=storage)
      float_shapes = jax.eval_shape(
          lambda t: Decoder(cfg).init(jax.random.key(0), t), tokens
      )
      shapes = jax.eval_shape(
          lambda v, c=c: serving.quantize_weights(c, v)[1],
          unbox(float_shapes),
      )
    out[storage] = serving.expert_weight_bytes(shapes)
  return out


def _human(n: int) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def main() -> None:
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
  args = parser.parse_args()

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
    result = generate_job.generate(
        args.decode_config,
        {},
        quantization=mode,
        train_steps=args.train_steps,
        batch_size=args.batch,
        prompt_len=args.prompt,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
    )
    print(generate_job.format_report(result))


if __name__ == "__main__":
  main()
