"""`linen-moe launch`: run `train` as N local processes joined by
jax.distributed, watched as one group (`linen_moe.distributed.launch`)."""

from __future__ import annotations

import argparse
import sys

# The flags `linen_moe.distributed.launch` gives each process.
PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "launch",
      help="run `train` as N local processes joined by jax.distributed",
      usage=(
          "linen-moe launch --local-processes N [--devices-per-process D] "
          "[--timeout SECONDS] -- train [train flags]"
      ),
  )
  p.add_argument(
      "--local-processes",
      type=int,
      required=True,
      metavar="N",
      help="processes to start on this machine, joined as one group",
  )
  p.add_argument(
      "--devices-per-process",
      type=int,
      default=None,
      metavar="D",
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


def train_command(argv: list[str]) -> list[str]:
  """The command line each process runs for `linen-moe launch -- ARGV`.

  Args:
    argv: the command after `--`, e.g. ["train", "--steps", "3"].

  Returns:
    `python -m linen_moe_cli.main ARGV`.

  Raises:
    ValueError: ARGV is not a `train` command, or sets the process flags
      the launcher adds.
  """
  if not argv or argv[0] != "train":
    raise ValueError(
        "launch runs `train` (the one command that joins processes); got "
        f"{' '.join(argv) or 'nothing'} after `--`."
    )
  given = [f for f in PROCESS_FLAGS if any(a.split("=")[0] == f for a in argv)]
  if given:
    raise ValueError(
        f"launch sets {', '.join(given)} itself; remove them from the command."
    )
  return [sys.executable, "-m", "linen_moe_cli.main", *argv]


def run(args: argparse.Namespace) -> int:
  from linen_moe import distributed  # noqa: PLC0415 (imports jax)

  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  return distributed.launch(
      train_command(command),
      args.local_processes,
      devices_per_process=args.devices_per_process,
      timeout_s=args.timeout,
  ).code
