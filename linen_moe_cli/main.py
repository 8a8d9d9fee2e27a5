"""The `linen-moe` command line: train, matrix, bench."""

from __future__ import annotations

import argparse
import sys
import time

from linen_moe.config import QUANTIZATIONS
from linen_moe.config import available_configs
from linen_moe_cli.train_job import FRONTENDS


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument(
      "--config",
      default="tiny_mixtral",
      help=(
          f"config name ({', '.join(available_configs())}) or a "
          "path to a .yml file"
      ),
  )
  p.add_argument(
      "--quantization",
      choices=QUANTIZATIONS,
      default=None,
      help="override the config's quantization",
  )
  p.add_argument(
      "--sparse-matmul",
      action=argparse.BooleanOptionalAction,
      default=None,
      help="override the config's matmul path",
  )
  p.add_argument(
      "--capacity-factor",
      type=float,
      default=None,
      help="override the capacity factor (<= 0: dropless)",
  )
  p.add_argument(
      "--layers",
      choices=("scanned", "unrolled"),
      default=None,
      help="scan the decoder blocks or unroll them",
  )


def model_overrides(args: argparse.Namespace) -> dict:
  """Config overrides named on the command line."""
  overrides = {}
  if args.quantization is not None:
    overrides["quantization"] = args.quantization
  if args.sparse_matmul is not None:
    overrides["sparse_matmul"] = args.sparse_matmul
  if args.capacity_factor is not None:
    overrides["capacity_factor"] = args.capacity_factor
  if args.layers is not None:
    overrides["scan_layers"] = args.layers == "scanned"
  return overrides


def cmd_train(args: argparse.Namespace) -> int:
  from linen_moe_cli import train_job  # noqa: PLC0415 (jax import is slow)

  start = time.perf_counter()
  result = train_job.train(
      args.config,
      model_overrides(args),
      steps=args.steps,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      learning_rate=args.learning_rate,
      grad_accum=args.grad_accum,
      seed=args.seed,
      progress=not args.no_progress,
      frontend=args.frontend,
  )
  print(
      f"steps: {args.steps}  first loss: {result.first_loss:.4f}  "
      f"final loss: {result.final_loss:.4f}  "
      f"best achievable: {result.best_loss:.4f}  "
      f"wall: {time.perf_counter() - start:.1f}s"
  )
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="linen-moe",
      description=(
          "Routed MoE for JAX: train the reference decoder, run the "
          "quantization x path matrix, benchmark."
      ),
  )
  sub = parser.add_subparsers(dest="command", required=True)

  train = sub.add_parser(
      "train", help="train the reference decoder on synthetic Markov data"
  )
  _add_model_args(train)
  train.add_argument("--steps", type=int, default=200)
  train.add_argument("--batch-size", type=int, default=16)
  train.add_argument("--seq-len", type=int, default=32)
  train.add_argument("--learning-rate", type=float, default=1e-2)
  train.add_argument(
      "--grad-accum", type=int, default=1, help="microbatches per step"
  )
  train.add_argument("--seed", type=int, default=0)
  train.add_argument(
      "--frontend",
      choices=FRONTENDS,
      default="linen",
      help="the Linen decoder or the NNX one (nnx_adapter)",
  )
  train.add_argument(
      "--no-progress", action="store_true", help="no progress bar"
  )
  train.set_defaults(func=cmd_train)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except ValueError as e:
    print(f"linen-moe: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
