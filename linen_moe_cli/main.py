"""The `linen-moe` command line: train, matrix, bench."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from linen_moe.config import QUANTIZATIONS
from linen_moe.config import available_configs


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
      mesh=args.mesh,
      frontend=args.frontend,
  )
  print(
      f"steps: {args.steps}  first loss: {result.first_loss:.4f}  "
      f"final loss: {result.final_loss:.4f}  "
      f"best achievable: {result.best_loss:.4f}  "
      f"wall: {time.perf_counter() - start:.1f}s"
  )
  return 0


def use_fast_compile() -> None:
  """Compiles at XLA's backend optimisation level 0 (must run before the first
  computation): about half the compile time of the many small programs the
  matrix builds, the same numerics, slower steps."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0"


# Compiled programs persist here (unless JAX_COMPILATION_CACHE_DIR says
# otherwise), shared by the test session and `linen-moe matrix` on one
# machine: the matrix cells the tests already compiled load instead.
COMPILATION_CACHE_DIR = os.path.join(
    tempfile.gettempdir(), "linen_moe_jax_cache"
)


def use_compilation_cache() -> None:
  """Turns on JAX's persistent compilation cache (before jax is imported, so
  that worker processes inherit it) for programs that took over a second."""
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE_DIR)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


def cmd_matrix(args: argparse.Namespace) -> int:
  if args.workers < 1:
    raise ValueError(f"--workers must be at least 1; got {args.workers}.")
  if args.fast_compile:
    use_fast_compile()
  use_compilation_cache()
  from linen_moe_cli import matrix  # noqa: PLC0415 (jax import is slow)

  if args.all:
    configs, frontends, layers = matrix.CONFIGS, matrix.FRONTENDS, matrix.LAYERS
  else:
    configs = (args.config,)
    frontends = (args.frontend,)
    layers = (args.layers or "scanned",)
  quantizations = (args.quantization,) if args.quantization else QUANTIZATIONS
  start = time.perf_counter()
  groups = [
      matrix.cells((config,), quantizations, frontends=(fe,), layers=(layer,))
      for config in configs
      for fe in frontends
      for layer in layers
  ]
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
          f"{r.cell.config}/{r.cell.frontend}/{r.cell.layers}/{r.cell.quantization}/{r.cell.path}"
          f" {r.compile_s:.1f}s/{r.step_s:.2f}s"
          for r in slowest
      )
  )
  print(
      f"{len(results) - len(failed)} passed, {len(failed)} failed "
      f"(matrix cells) in {time.perf_counter() - start:.0f}s"
  )
  return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
  from linen_moe_cli import bench_report  # noqa: PLC0415

  rows = bench_report.run(
      args.sweep,
      args.quantization or ("none",),
      tuple(args.target or ("layer",)),
      args.repeats,
      args.out,
      dtypes=tuple(args.dtype),
      peer_path=args.peer,
  )
  return 1 if any("error" in r for r in rows) else 0


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
      "--mesh",
      default=None,
      help=(
          "train sharded on a device mesh, e.g. data=2,expert=4 (axes data, "
          "fsdp, expert, tensor; missing axes have size 1; the sizes must "
          "multiply to the device count)"
      ),
  )
  train.add_argument(
      "--frontend",
      choices=("linen", "nnx"),
      default="linen",
      help="the Linen decoder or the NNX one (nnx_adapter)",
  )
  train.add_argument(
      "--no-progress", action="store_true", help="no progress bar"
  )
  train.set_defaults(func=cmd_train)

  mat = sub.add_parser(
      "matrix", help="train one step in every quantization x path cell"
  )
  mat.add_argument("--config", default="tiny_mixtral")
  mat.add_argument(
      "--quantization",
      choices=QUANTIZATIONS,
      default=None,
      help="one row only (default: all modes)",
  )
  mat.add_argument("--layers", choices=("scanned", "unrolled"), default=None)
  mat.add_argument("--frontend", choices=("linen", "nnx"), default="linen")
  mat.add_argument(
      "--all",
      action="store_true",
      help="every config x front end x layers (ignores the rest)",
  )
  mat.add_argument(
      "--fast-compile",
      action=argparse.BooleanOptionalAction,
      default=True,
      help=(
          "compile at XLA backend optimisation level 0 (about "
          "half the compile time; step times not representative)"
      ),
  )
  mat.add_argument(
      "--workers",
      type=int,
      default=min(2, os.cpu_count() or 1),
      help=(
          "processes that compile and run cells side by side (default: 2, "
          "or 1 on a single core)"
      ),
  )
  mat.set_defaults(func=cmd_matrix)

  bench = sub.add_parser(
      "bench", help="time forward+backward of the layer across sizes/paths"
  )
  bench.add_argument(
      "--sweep",
      nargs="+",
      default=["sizes", "implementations", "experts", "capacity"],
      choices=("sizes", "implementations", "experts", "capacity"),
  )
  bench.add_argument(
      "--quantization",
      nargs="+",
      choices=QUANTIZATIONS,
      default=None,
      help="default: none",
  )
  bench.add_argument(
      "--target",
      nargs="+",
      choices=("layer", "decoder_layer"),
      default=None,
      help="default: layer",
  )
  bench.add_argument(
      "--dtype",
      nargs="+",
      choices=("float32", "bfloat16"),
      default=["float32", "bfloat16"],
      help="compute/weight dtypes of the sizes sweep (default: both)",
  )
  bench.add_argument(
      "--peer",
      default=None,
      metavar="JSON",
      help=(
          "another library's results for the same cases (see "
          "linen_moe_cli/bench_peer.py), shown beside ours in the table "
          "and the chart"
      ),
  )
  bench.add_argument("--repeats", type=int, default=5)
  bench.add_argument("--out", default="benchmarks/results")
  bench.set_defaults(func=cmd_bench)
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
