"""`linen-moe launch`: run `train` as N local processes joined by
jax.distributed, watched as one group (`linen_moe_cli.launch`)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "launch",
      help="run `train` as N local processes joined by jax.distributed",
      usage=(
          "linen-moe launch --local-processes N [--devices-per-process D] "
          "[--timeout SECONDS] -- train [train flags]"
      ),
  )
  p.add_argument("--local-processes", type=int, required=True)
  p.add_argument(
      "--devices-per-process",
      type=int,
      default=None,
      help="simulate D CPU devices in each process (default: JAX's devices)",
  )
  p.add_argument(
      "--timeout",
      type=float,
      default=3600.0,
      metavar="SECONDS",
      help="stop every process and fail past this",
  )
  p.add_argument(
      "command", nargs=argparse.REMAINDER, help="-- train [train flags]"
  )
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  from linen_moe_cli import launch  # noqa: PLC0415 (imports jax)

  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  return launch.launch(
      command,
      args.local_processes,
      args.devices_per_process,
      timeout_s=args.timeout,
  )
