"""LoRA and QLoRA memory: a compiled train step's parameter and optimizer
bytes against full fine-tuning, at a real model's shape.

Three steps of the same decoder (default `qwen3_30b_a3b` cut to 2 layers,
batch 1, sequence 2048), compiled for this machine's CPU and never run
(every state is `jax.eval_shape`'s, nothing is allocated):

  full    AdamW on every parameter (the float base, bfloat16 here);
  lora    the float base frozen, rank-r adapters on every expert,
          shared expert, MLP and attention kernel trained;
  qlora   the same adapters on a frozen int8 serving base (the expert
          kernels int8 with their scales, `linen_moe.quantization`).

For each: the bytes of the state's parameters and optimizer moments (from
its leaves), the compiled program's argument, output and temporary bytes
(`compiled.memory_analysis()`), and the ratios to full fine-tuning. With
`--count`, the trainable parameters of rank r on the whole model (all
layers), from `jax.eval_shape`.

  python benchmarks/lora/bench_lora_memory.py
  python benchmarks/lora/bench_lora_memory.py --count --layers 2 --seq 2048
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe import lora
from linen_moe import training


def _bytes(tree) -> int:
  return sum(
      int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(tree)
  )


def _config(name: str, case: str, layers: int, rank: int):
  cfg = load_model_config(name).replace(num_layers=layers)
  if case == "qlora":
    cfg = cfg.replace(quantization="int8", serving=True)
  if case != "full":
    cfg = cfg.replace(lora_rank=rank, lora_alpha=2 * rank)
  return cfg


def measure(name: str, case: str, layers: int, seq: int, rank: int) -> dict:
  """Compiles one train step; returns its byte counts."""
  cfg = _config(name, case, layers, rank)
  model = Decoder(cfg)
  optimizer = optax.adamw(1e-4)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  state = jax.eval_shape(
      lambda t, r: training.init_train_state(model, optimizer, t, r),
      tokens,
      key,
  )
  step = jax.jit(training.make_train_step(model, optimizer))
  compiled = step.lower(state, tokens, key).compile()
  memory = compiled.memory_analysis()
  return {
      "params": _bytes(state.params),
      "opt": _bytes(state.opt_state),
      "trainable": lora.count_trainable(state.params) if case != "full" else 0,
      "argument": memory.argument_size_in_bytes,
      "output": memory.output_size_in_bytes,
      "temp": memory.temp_size_in_bytes,
  }


def count(name: str, rank: int) -> tuple[int, int]:
  """(adapter parameters of rank r on every target, base parameters) of
  the whole model, from shapes."""
  cfg = load_model_config(name).replace(lora_rank=rank)
  shapes = jax.eval_shape(
      Decoder(cfg).init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32)
  )["params"]
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  adapters = lora.count_trainable(shapes)
  return adapters, total - adapters


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="qwen3_30b_a3b")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--cases", default="full,lora,qlora")
  p.add_argument("--count", action="store_true")
  args = p.parse_args()
  if args.count:
    adapters, base = count(args.config, args.rank)
    print(
        f"{args.config}: rank {args.rank} on every target: {adapters:,} "
        f"trainable parameters ({100 * adapters / base:.3f}% of the "
        f"{base:,} of the base)"
    )
  gib = 2.0**30
  rows = {}
  for case in args.cases.split(","):
    rows[case] = measure(args.config, case, args.layers, args.seq, args.rank)
    r = rows[case]
    print(
        f"{case:6s} params {r['params'] / gib:7.3f} GiB  optimizer "
        f"{r['opt'] / gib:7.3f} GiB  params+opt "
        f"{(r['params'] + r['opt']) / gib:7.3f} GiB  compiled: arguments "
        f"{r['argument'] / gib:7.3f}  outputs {r['output'] / gib:7.3f}  "
        f"temp {r['temp'] / gib:7.3f} GiB",
        flush=True,
    )
  if "full" in rows:
    full = rows["full"]
    for case, r in rows.items():
      if case == "full":
        continue
      print(
          f"{case} / full: params+opt "
          f"{(r['params'] + r['opt']) / (full['params'] + full['opt']):.3f}"
          f"  optimizer {r['opt'] / full['opt']:.5f}  compiled arguments "
          f"{r['argument'] / full['argument']:.3f}  temp "
          f"{r['temp'] / max(full['temp'], 1):.3f}"
      )


if __name__ == "__main__":
  main()
