"""`linen-moe bench`: time forward+backward of the layer across sizes and
paths, each case in its own process (`bench`, `bench_report`)."""

from __future__ import annotations

import argparse
import sys

from linen_moe._src.config.moe_config import QUANTIZATIONS
from linen_moe_cli import bench_report  # imports jax only to run a case
from linen_moe_cli import options
from linen_moe_cli import run_directory


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "bench", help="time forward+backward of the layer across sizes/paths"
  )
  p.add_argument(
      "--sweep",
      nargs="+",
      default=list(bench_report.SWEEPS),
      choices=bench_report.SWEEPS,
  )
  p.add_argument(
      "--quantization",
      nargs="+",
      choices=QUANTIZATIONS,
      default=None,
      help="default: none",
  )
  p.add_argument(
      "--target",
      nargs="+",
      choices=("layer", "decoder_layer"),
      default=None,
      help="default: layer",
  )
  p.add_argument(
      "--dtype",
      nargs="+",
      choices=("float32", "bfloat16"),
      default=["float32", "bfloat16"],
      help="compute/weight dtypes of the sizes sweep (default: both)",
  )
  p.add_argument(
      "--peer",
      default=None,
      metavar="JSON",
      help=(
          "another library's results for the same cases (see "
          "linen_moe_cli/bench_peer.py), shown beside ours in the table "
          "and the chart"
      ),
  )
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default="benchmarks/results")
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  options.check_int("repeats", args.repeats, 1)
  run_directory.writable_directory(args.out, "--out")
  no_chart = options.missing_optional(
      "matplotlib", "the chart (bench.png) is skipped; bench.json is written"
  )
  if no_chart:
    print(f"linen-moe bench: {no_chart}", file=sys.stderr)
  rows = bench_report.run(
      args.sweep,
      args.quantization or ("none",),
      tuple(args.target or ("layer",)),
      args.repeats,
      args.out,
      dtypes=tuple(args.dtype),
      peer_path=args.peer,
      chart=not no_chart,
  )
  return 1 if any("error" in r for r in rows) else 0
