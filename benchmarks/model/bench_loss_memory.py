"""What the vocabulary adds to the train step's memory: full logits against
the chunked loss.

  python benchmarks/model/bench_loss_memory.py [--model qwen3_30b_a3b]
      [--layers 2] [--seq 8192] [--batch 1] [--small-vocab 1024]

Compiles (never runs) the gradient of the decoder's loss with respect to
its parameters, on abstract inputs (nothing is allocated), for the model's
shape with `--layers` layers (bf16 as the config has it), at batch x seq
tokens, and prints XLA's `memory_analysis()` temporary bytes for:

  logits   `decoder_loss` of the decoder's [B, S, V] float32 logits
  chunked  `hidden_decoder_loss`: the head applied chunk by chunk
           (`chunked_cross_entropy`), what the train steps run

each with the model's vocabulary and with `--small-vocab`; "vocab adds" is
the difference, what the vocabulary costs in temporaries. The CPU backend's
figures; the program is the same on an accelerator.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import linen_moe
from linen_moe import frontend
from linen_moe import models
from linen_moe import training


def temp_bytes(cfg, batch: int, seq: int, chunked: bool) -> int:
  """Temporary bytes of the compiled gradient of the loss."""
  model = linen_moe.Decoder(cfg)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  variables = jax.eval_shape(
      lambda t: linen_moe.sharding.unbox(model.init(jax.random.key(0), t)),
      tokens,
  )

  def loss(params, tokens):
    v = {**variables, "params": params}
    if chunked:
      hidden, aux = model.clone(hidden_only=True).apply(v, tokens)
      return frontend.hidden_decoder_loss(
          hidden,
          models.output_kernel(cfg, params),
          aux,
          tokens,
          softcap=cfg.final_logit_softcap,
      )[0]
    logits, aux = model.apply(v, tokens)
    return training.decoder_loss(logits, aux, tokens)[0]

  lowered = jax.jit(jax.grad(loss)).lower(variables["params"], tokens)
  return lowered.compile().memory_analysis().temp_size_in_bytes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="qwen3_30b_a3b")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--small-vocab", type=int, default=1024)
  args = parser.parse_args()
  base = linen_moe.load_model_config(args.model).replace(num_layers=args.layers)
  gb = 1e9
  print(
      f"{args.model}, {args.layers} layers, batch {args.batch} x "
      f"{args.seq}, {base.moe.dtype}; temp GB of jit(grad(loss)) (CPU)"
  )
  print(
      f"{'loss':>8} {'V=' + str(base.vocab_size):>10} "
      f"{'V=' + str(args.small_vocab):>8} {'vocab adds':>10} {'compile s':>9}"
  )
  for chunked in (False, True):
    start = time.perf_counter()
    full = temp_bytes(base, args.batch, args.seq, chunked)
    small_cfg = base.replace(vocab_size=args.small_vocab)
    small = temp_bytes(small_cfg, args.batch, args.seq, chunked)
    seconds = time.perf_counter() - start
    name = "chunked" if chunked else "logits"
    print(
        f"{name:>8} {full / gb:>10.2f} {small / gb:>8.2f} "
        f"{(full - small) / gb:>10.2f} {seconds:>9.0f}"
    )


if __name__ == "__main__":
  main()
