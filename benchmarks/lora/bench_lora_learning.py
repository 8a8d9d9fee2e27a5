"""LoRA and QLoRA learn: held-out loss on a small real corpus.

The corpus is the license texts of the installed dependencies
(`linen_moe.testing.license_texts`, ~160 KB of English), tokenized by a
BPE trained on them (`linen_moe.data.train_bpe_tokenizer`); every 10th
window is held out. The model is a Hugging Face fixture's architecture
(default tests/fixtures/hf/qwen3_moe_dense0_norm: Qwen3-MoE with a dense
first layer), its vocabulary resized to the tokenizer's. Then:

  1. base    full training for --base-steps (a stand-in for a released
             model), then frozen;
  2. lora    rank-r adapters on every target on the float base,
             --steps of AdamW;
  3. qlora   the same adapters (same init) on the base converted to int8
             serving weights (`linen_moe.quantization.quantize_weights`),
             the same steps.

It prints the held-out loss of the base (float and int8), after LoRA and
after QLoRA, and QLoRA's loss relative to LoRA's.

  python benchmarks/lora/bench_lora_learning.py
  python benchmarks/lora/bench_lora_learning.py --steps 200 --rank 8
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import Decoder
from linen_moe import data
from linen_moe import hf
from linen_moe import lora
from linen_moe import quantization
from linen_moe import testing
from linen_moe import training
from linen_moe.sharding import unbox

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "qwen3_moe_dense0_norm"


def windows(vocab: int, seq: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(train [N, seq], held-out [M, seq] windows, vocabulary size)."""
  paths = testing.license_texts()
  tok = data.train_bpe_tokenizer(paths, vocab)
  ids = []
  for path in paths:
    ids += tok.encode(pathlib.Path(path).read_text(encoding="utf-8")).ids
    ids.append(0)
  rows = np.asarray(ids[: len(ids) // seq * seq], np.int32).reshape(-1, seq)
  held = np.arange(len(rows)) % 10 == 0
  return rows[~held], rows[held], tok.get_vocab_size()


def train(cfg, variables, rows, steps, lr, batch, seed):
  """`steps` AdamW steps on random batches of `rows`; the new variables."""
  optimizer = optax.adamw(lr)
  state = training.train_state_from_variables(variables, optimizer)
  step = jax.jit(training.make_train_step(Decoder(cfg), optimizer))
  rng = np.random.default_rng(seed)
  for i in range(steps):
    tokens = jnp.asarray(rows[rng.integers(0, len(rows), batch)])
    state, _ = step(state, tokens, jax.random.key(i))
  return {**variables, "params": state.params}


def held_out_loss(cfg, variables, rows, batch=16) -> float:
  forward = jax.jit(lambda v, t: Decoder(cfg).apply(v, t)[0])
  losses = []
  for i in range(0, len(rows) - batch + 1, batch):
    tokens = jnp.asarray(rows[i : i + batch])
    losses.append(
        float(training.cross_entropy(forward(variables, tokens), tokens))
    )
  return float(np.mean(losses))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--base-steps", type=int, default=150)
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--lora-lr", type=float, default=1e-2)
  args = p.parse_args()

  train_rows, held_rows, vocab = windows(args.vocab, args.seq)
  config_json = json.loads((FIXTURE / "config.json").read_text())
  base_cfg = hf.model_config(config_json).replace(vocab_size=vocab)
  init = Decoder(base_cfg).init(jax.random.key(0), jnp.asarray(train_rows[:1]))
  base = train(
      base_cfg, unbox(init), train_rows, args.base_steps, args.lr, args.batch, 0
  )
  results = {"base": held_out_loss(base_cfg, base, held_rows)}

  lora_cfg = base_cfg.replace(lora_rank=args.rank, lora_alpha=2 * args.rank)
  adapted = lora.init_adapters(lora_cfg, base, jax.random.key(1))
  trained = train(
      lora_cfg, adapted, train_rows, args.steps, args.lora_lr, args.batch, 1
  )
  results["lora"] = held_out_loss(lora_cfg, trained, held_rows)

  int8_cfg, int8_base = quantization.quantize_weights(
      base_cfg.replace(quantization="int8"), base
  )
  results["base_int8"] = held_out_loss(int8_cfg, int8_base, held_rows)
  qlora_cfg = int8_cfg.replace(lora_rank=args.rank, lora_alpha=2 * args.rank)
  adapted = lora.init_adapters(qlora_cfg, int8_base, jax.random.key(1))
  trained = train(
      qlora_cfg, adapted, train_rows, args.steps, args.lora_lr, args.batch, 1
  )
  results["qlora"] = held_out_loss(qlora_cfg, trained, held_rows)

  print(
      f"corpus: {len(train_rows)} train / {len(held_rows)} held-out windows "
      f"of {args.seq} tokens, vocabulary {vocab}; base {args.base_steps} "
      f"steps, adapters rank {args.rank} for {args.steps} steps"
  )
  for name in ("base", "base_int8", "lora", "qlora"):
    print(f"held-out loss {name:9s} {results[name]:.4f}")
  rel = (results["qlora"] - results["lora"]) / results["lora"]
  print(f"qlora vs lora: {100 * rel:+.2f}%")


if __name__ == "__main__":
  main()
