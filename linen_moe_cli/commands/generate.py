"""`linen-moe generate`: convert the decoder's expert weights for serving
and decode greedily with a KV cache, float and converted side by side
(`generate_job`)."""

from __future__ import annotations

import argparse

from linen_moe_cli import model_args


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "generate",
      help=(
          "convert the decoder's expert weights for serving and decode "
          "greedily with a KV cache, float vs converted"
      ),
  )
  model_args.add_model_args(p)
  p.set_defaults(quantization="int8")
  p.add_argument(
      "--train-steps",
      type=int,
      default=50,
      help="train this many steps first, in the serving mode (0: fresh init)",
  )
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3, help="timed runs")
  p.add_argument("--seed", type=int, default=0)
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  from linen_moe_cli import generate_job  # noqa: PLC0415 (imports jax)

  overrides = model_args.model_overrides(args)
  overrides.pop("quantization", None)
  result = generate_job.generate(
      args.config,
      overrides,
      quantization=args.quantization or "int8",
      train_steps=args.train_steps,
      batch_size=args.batch_size,
      prompt_len=args.prompt_len,
      new_tokens=args.new_tokens,
      seed=args.seed,
      repeats=args.repeats,
  )
  print(generate_job.format_report(result))
  return 0
