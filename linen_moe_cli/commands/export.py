"""`linen-moe export`: a checkpoint's serving variables, no optimizer state.

Only reads the run's directory: it needs no lock, and may run beside a
training run on the same directory.
"""

from __future__ import annotations

import argparse

from linen_moe_cli import run_directory


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "export",
      help="write a checkpoint's serving variables (no optimizer state)",
  )
  p.add_argument("--checkpoint-dir", required=True)
  p.add_argument("--out", required=True, help="a new directory")
  p.add_argument(
      "--dtype",
      choices=("float32", "bfloat16", "float16"),
      default=None,
      help="cast the parameters (fp8 state stays float32)",
  )
  p.add_argument("--step", type=int, default=None, help="default: the latest")
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  run_directory.creatable(args.out, "--out")
  from linen_moe import checkpoint  # noqa: PLC0415 (imports jax)

  step = checkpoint.export(
      args.checkpoint_dir, args.out, dtype=args.dtype, step=args.step
  )
  print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
  return 0
