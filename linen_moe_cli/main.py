"""The `linen-moe` command line: its subcommands, assembled.

Each subcommand is a module of `linen_moe_cli.commands`; this one builds the
parser from them and turns the errors a user can fix into one line on
stderr: a bad flag or input (`ValueError`, exit 2), a run that stopped on
purpose (`linen_moe.training.RunStopped`, exit 1), a missing optional package (exit 2).
"""

from __future__ import annotations

import argparse
import sys

from linen_moe.training import RunStopped
from linen_moe.training import reuse_host_memory
from linen_moe_cli import commands
from linen_moe_cli import options


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="linen-moe",
      description=(
          "Routed MoE for JAX: train the reference decoder, decode from "
          "a checkpoint, export it, run the quantization x path matrix."
      ),
  )
  subparsers = parser.add_subparsers(dest="command", required=True)
  for command in commands.COMMANDS:
    command.register(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.run(args)
  except ValueError as e:
    print(f"linen-moe: error: {e}", file=sys.stderr)
    return 2
  except RunStopped as e:
    print(f"linen-moe: error: {e}", file=sys.stderr)
    return 1
  except ModuleNotFoundError as e:  # an optional package no check foresaw
    needed = options.missing_optional(e.name or str(e), "this command stops")
    print(f"linen-moe: error: {needed or e}", file=sys.stderr)
    return 2


# The subcommands whose time goes to running compiled steps, not to compiling
# them: with LINEN_MOE_REUSE_HOST_MEMORY=1 they restart with host memory that
# the programs reuse (`linen_moe.training.reuse_host_memory`). One malloc arena slows compiling, which
# is most of what `matrix` (a few steps of each of 200 cells) does.
STEP_BOUND_COMMANDS = ("train", "generate", "launch")


def console() -> int:
  """The `linen-moe` command: `main`, restarted first for the
  `STEP_BOUND_COMMANDS` with host memory that compiled programs reuse when
  `LINEN_MOE_REUSE_HOST_MEMORY=1` asks for it."""
  if sys.argv[1:2] and sys.argv[1] in STEP_BOUND_COMMANDS:
    reuse_host_memory()
  return main()


if __name__ == "__main__":
  sys.exit(console())
