"""The `linen-moe` command line: train, matrix, bench."""

from __future__ import annotations

import argparse
import os
import sys
import time

import yaml

from linen_moe._src import compile_options
from linen_moe._src.config import QUANTIZATIONS
from linen_moe._src.config import available_configs
from linen_moe.distributed import DEFAULT_HEARTBEAT_TIMEOUT_S
from linen_moe.distributed import DEFAULT_INIT_TIMEOUT_S
from linen_moe_cli import options


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
  p.add_argument(
      "--set",
      action="append",
      default=[],
      metavar="FIELD=VALUE",
      help=(
          "override any config field (repeatable; the value is read as YAML), "
          "e.g. --set routed_bias=false --set router_z_loss_weight=1e-3"
      ),
  )


def parse_set(items: list[str]) -> dict:
  """["field=value", ...] -> {field: YAML value}; raises ValueError on an
  item without '=' (unknown fields are the config's to reject)."""
  overrides = {}
  for item in items:
    field, sep, value = item.partition("=")
    if not sep or not field.strip():
      raise ValueError(
          f"--set {item!r}: expected FIELD=VALUE, e.g. routed_bias=false."
      )
    overrides[field.strip()] = yaml.safe_load(value)
  return overrides


def _add_process_args(p: argparse.ArgumentParser) -> None:
  group = p.add_argument_group(
      "multiple processes",
      "one process per host joined by jax.distributed (none of these under "
      "Slurm srun, Open MPI mpirun or a Cloud TPU pod, which JAX detects)",
  )
  group.add_argument(
      "--coordinator",
      default=None,
      metavar="HOST:PORT",
      help="address of process 0, which serves the coordination service",
  )
  group.add_argument(
      "--num-processes", type=int, default=None, help="N, all processes"
  )
  group.add_argument(
      "--process-id", type=int, default=None, help="this process, in [0, N)"
  )
  group.add_argument(
      "--init-timeout",
      type=int,
      default=DEFAULT_INIT_TIMEOUT_S,
      metavar="SECONDS",
      help="give up when the processes have not all joined by then",
  )
  group.add_argument(
      "--heartbeat-timeout",
      type=int,
      default=DEFAULT_HEARTBEAT_TIMEOUT_S,
      metavar="SECONDS",
      help="a silent process counts as dead after this; the others then stop",
  )


def model_overrides(args: argparse.Namespace) -> dict:
  """Config overrides named on the command line."""
  overrides = parse_set(args.set)
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
  options.check_train_options(
      steps=args.steps,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      learning_rate=args.learning_rate,
      grad_accum=args.grad_accum,
      max_consecutive_skips=args.max_consecutive_skips,
      checkpoint_dir=args.checkpoint_dir,
      save_every=args.save_every,
      keep=args.keep,
  )
  from linen_moe import distributed  # noqa: PLC0415 (jax import is slow)

  several = distributed.initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      init_timeout_s=args.init_timeout,
      heartbeat_timeout_s=args.heartbeat_timeout,
  )
  if not several:
    return _train(args)
  try:
    return _train(args)
  except (ValueError, options.RunStopped):
    # Every process rejects the same input, and sees the same (replicated)
    # skipped steps: they exit together.
    raise
  except BaseException:  # noqa: BLE001
    # Leave now: the normal exit waits at a shutdown barrier for peers that
    # may be blocked in a collective with this process. Once its heartbeats
    # stop, JAX terminates the others with an error.
    import traceback  # noqa: PLC0415

    print(f"[process {args.process_id}]", file=sys.stderr)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _train(args: argparse.Namespace) -> int:
  from linen_moe import distributed  # noqa: PLC0415
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
      checkpoint_dir=args.checkpoint_dir,
      save_every=args.save_every,
      keep=args.keep,
      fresh_fp8_state=args.fresh_fp8_state,
      max_consecutive_skips=args.max_consecutive_skips,
  )
  if not result.losses:  # already at --steps
    return 0
  if distributed.is_main_process():
    load = ""
    if result.expert_load is not None:
      load = f"expert load max/min: {result.load_ratio:.2f}  "
    print(
        f"steps: {result.start_step + 1}-{args.steps}  first loss:"
        f" {result.first_loss:.4f}  final loss: {result.final_loss:.4f}  "
        f"best achievable: {result.best_loss:.4f}  "
        f"skipped steps: {result.skipped_steps}  "
        f"{load}wall: {time.perf_counter() - start:.1f}s"
    )
  return 0


def cmd_export(args: argparse.Namespace) -> int:
  from linen_moe import checkpoint  # noqa: PLC0415 (jax import is slow)

  step = checkpoint.export(
      args.checkpoint_dir, args.out, dtype=args.dtype, step=args.step
  )
  print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
  return 0


def cmd_matrix(args: argparse.Namespace) -> int:
  if args.workers < 1:
    raise ValueError(f"--workers must be at least 1; got {args.workers}.")
  if args.fast_compile:
    compile_options.use_fast_compile()
  compile_options.use_compilation_cache()
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


def cmd_generate(args: argparse.Namespace) -> int:
  from linen_moe_cli import generate_job  # noqa: PLC0415 (jax import is slow)

  overrides = model_overrides(args)
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


def cmd_bench(args: argparse.Namespace) -> int:
  options.check_int("repeats", args.repeats, 1)
  no_chart = options.missing_optional(
      "matplotlib", "the chart (bench.png) is skipped; bench.json is written"
  )
  if no_chart:
    print(f"linen-moe bench: {no_chart}", file=sys.stderr)
  from linen_moe_cli import bench_report  # noqa: PLC0415

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


def cmd_launch(args: argparse.Namespace) -> int:
  from linen_moe_cli import launch  # noqa: PLC0415

  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  return launch.launch(
      command,
      args.local_processes,
      args.devices_per_process,
      timeout_s=args.timeout,
  )


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
      "--max-consecutive-skips",
      type=int,
      default=10,
      help=(
          "stop after this many steps in a row were skipped for a "
          "non-finite loss or gradient"
      ),
  )
  train.add_argument(
      "--no-progress", action="store_true", help="no progress bar"
  )
  train.add_argument(
      "--checkpoint-dir",
      default=None,
      help=(
          "save checkpoints here and resume from the latest one (any front "
          "end, layer mode or mesh); per-step metrics in DIR/metrics.jsonl"
      ),
  )
  train.add_argument(
      "--save-every",
      type=int,
      default=None,
      help="save every N steps (default: only the last step)",
  )
  train.add_argument(
      "--keep", type=int, default=3, help="keep the latest K checkpoints"
  )
  train.add_argument(
      "--fresh-fp8-state",
      action="store_true",
      help=(
          "resume a checkpoint whose fp8 state does not fit the model "
          "(e.g. trained unquantized) with fresh fp8 state"
      ),
  )
  _add_process_args(train)
  train.set_defaults(func=cmd_train)

  export = sub.add_parser(
      "export",
      help="write a checkpoint's serving variables (no optimizer state)",
  )
  export.add_argument("--checkpoint-dir", required=True)
  export.add_argument("--out", required=True, help="a new directory")
  export.add_argument(
      "--dtype",
      choices=("float32", "bfloat16", "float16"),
      default=None,
      help="cast the parameters (fp8 state stays float32)",
  )
  export.add_argument(
      "--step", type=int, default=None, help="default: the latest"
  )
  export.set_defaults(func=cmd_export)

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

  launch = sub.add_parser(
      "launch",
      help="run `train` as N local processes joined by jax.distributed",
      usage=(
          "linen-moe launch --local-processes N [--devices-per-process D] "
          "[--timeout SECONDS] -- train [train flags]"
      ),
  )
  launch.add_argument("--local-processes", type=int, required=True)
  launch.add_argument(
      "--devices-per-process",
      type=int,
      default=None,
      help="simulate D CPU devices in each process (default: JAX's devices)",
  )
  launch.add_argument(
      "--timeout",
      type=float,
      default=3600.0,
      metavar="SECONDS",
      help="stop every process and fail past this",
  )
  launch.add_argument(
      "command", nargs=argparse.REMAINDER, help="-- train [train flags]"
  )
  launch.set_defaults(func=cmd_launch)

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
  gen = sub.add_parser(
      "generate",
      help=(
          "convert the decoder's expert weights for serving and decode "
          "greedily with a KV cache, float vs converted"
      ),
  )
  _add_model_args(gen)
  gen.set_defaults(quantization="int8")
  gen.add_argument(
      "--train-steps",
      type=int,
      default=50,
      help="train this many steps first, in the serving mode (0: fresh init)",
  )
  gen.add_argument("--batch-size", type=int, default=8)
  gen.add_argument("--prompt-len", type=int, default=16)
  gen.add_argument("--new-tokens", type=int, default=32)
  gen.add_argument("--repeats", type=int, default=3, help="timed runs")
  gen.add_argument("--seed", type=int, default=0)
  gen.set_defaults(func=cmd_generate)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except ValueError as e:
    print(f"linen-moe: error: {e}", file=sys.stderr)
    return 2
  except options.RunStopped as e:
    print(f"linen-moe: error: {e}", file=sys.stderr)
    return 1
  except ModuleNotFoundError as e:  # an optional package no check foresaw
    needed = options.missing_optional(e.name or str(e), "this command stops")
    print(f"linen-moe: error: {needed or e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
