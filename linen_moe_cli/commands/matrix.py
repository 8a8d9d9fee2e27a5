"""`linen-moe matrix`: train one step in every quantization x path cell
(`linen_moe_cli.matrix`), in worker processes that share the compilation
cache with the test suite."""

from __future__ import annotations

import argparse
import os
import time

from linen_moe import testing
from linen_moe import training
from linen_moe.quantization import MODES
from linen_moe_cli import options
from linen_moe_cli.model_args import LAYERS


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "matrix", help="train one step in every quantization x path cell"
  )
  p.add_argument(
      "--config",
      default="tiny_mixtral",
      help="a config name (train --help lists them) or a path to a .yml file",
  )
  p.add_argument(
      "--quantization",
      choices=tuple(MODES),
      default=None,
      help="one row only (default: all modes)",
  )
  p.add_argument(
      "--layers",
      choices=LAYERS,
      default=None,
      help="scan the decoder blocks or unroll them (default: scanned)",
  )
  p.add_argument(
      "--frontend",
      choices=tuple(training.FRONTENDS),
      default="linen",
      help=options.frontend_help(),
  )
  p.add_argument(
      "--all",
      action="store_true",
      help=(
          f"the layer's configs ({', '.join(testing.TINY_CONFIGS)}) x front"
          " end x layers, and the whole-model configs"
          f" ({', '.join(testing.FAMILY_CONFIGS)}) in every mode on one path"
          " each (ignores the rest)"
      ),
  )
  p.add_argument(
      "--fast-compile",
      action=argparse.BooleanOptionalAction,
      default=True,
      help=(
          "compile at XLA backend optimisation level 0 (about "
          "half the compile time; step times not representative)"
      ),
  )
  p.add_argument(
      "--workers",
      type=int,
      default=min(2, os.cpu_count() or 1),
      help=(
          "processes that compile and run cells side by side (at most 2; one"
          " on a single core)"
      ),
  )
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  if args.workers < 1:
    raise ValueError(f"--workers must be at least 1; got {args.workers}.")
  if args.fast_compile:
    testing.use_fast_compile()
  testing.use_compilation_cache()
  from linen_moe_cli import matrix  # noqa: PLC0415 (imports jax)

  if args.all:
    configs, fes, layers = matrix.CONFIGS, tuple(training.FRONTENDS), LAYERS
  else:
    configs = (args.config,)
    fes = (args.frontend,)
    layers = (args.layers or "scanned",)
  quantizations = (args.quantization,) if args.quantization else tuple(MODES)
  start = time.perf_counter()
  groups = [
      matrix.cells((config,), quantizations, frontends=(fe,), layers=(layer,))
      for config in configs
      for fe in fes
      for layer in layers
  ]
  if args.all:
    groups += matrix.family_cells(quantizations)
  results = []
  for group in matrix.run_cells(groups, args.workers):
    results.extend(group)
    print(matrix.format_table(group), flush=True)
    print(flush=True)
  failed = [r for r in results if not r.ok]
  slowest = sorted(results, key=lambda r: r.compile_s, reverse=True)[:3]
  print(
      "slowest cells (compile / step seconds): "
      + "; ".join(
          f"{r.cell.config}/{r.cell.frontend}/{r.cell.layers}/"
          f"{r.cell.quantization}/{r.cell.path}"
          f" {r.compile_s:.1f}s/{r.step_s:.2f}s"
          for r in slowest
      )
  )
  print(
      f"{len(results) - len(failed)} passed, {len(failed)} failed "
      f"(matrix cells) in {time.perf_counter() - start:.0f}s"
  )
  return 1 if failed else 0
