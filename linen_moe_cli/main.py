"""The `linen-moe` command line: its subcommands, assembled.

Each subcommand is a module of `linen_moe_cli.commands`; this one builds the
parser from them and turns the errors a user can fix into one line on
stderr: a bad flag or input (`ValueError`, exit 2), a run that stopped on
purpose (`linen_moe.training.RunStopped`, exit 1), a missing optional package (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import sys

import linen_moe
from linen_moe.training import RunStopped
from linen_moe.training import reuse_host_memory
from linen_moe_cli import commands
from linen_moe_cli import options


class DefaultsHelp(argparse.HelpFormatter):
  """Help that says each option's default (unless it has none to say)."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    default = action.default
    shown = not (
        default is None
        or default is False  # a flag's "off"; 0 is a value to show
        or default is argparse.SUPPRESS
        or default == []
    )
    if shown and action.option_strings and "%(default)" not in text:
      text += " (default: %(default)s)"
    return text


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="linen-moe",
      description=(
          "Routed MoE for JAX: train the reference decoder or fine-tune a "
          "Hugging Face checkpoint, decode from a checkpoint, export it, "
          "plan a run, run the quantization x path matrix, launch local "
          "processes, train a tokenizer. `linen-moe COMMAND --help` for each."
      ),
  )
  parser.add_argument(
      "--version", action="store_true", help="print the version and exit"
  )
  subparsers = parser.add_subparsers(
      dest="command",
      required=True,
      parser_class=functools.partial(
          argparse.ArgumentParser, formatter_class=DefaultsHelp
      ),
  )
  for command in commands.COMMANDS:
    command.register(subparsers)
  parser.command_parsers = subparsers.choices  # name -> its parser
  return parser


def _parse(argv: list[str]) -> argparse.Namespace:
  """The parsed command line; a flag the command does not know is that
  command's error (its usage, not the top-level one's)."""
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  if unknown:
    parser.command_parsers[args.command].error(
        f"unrecognized arguments: {' '.join(unknown)}"
    )
  return args


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["--version"]:
    if len(argv) > 1:
      print(
          "linen-moe: error: --version takes no other arguments (got "
          f"{' '.join(argv)})",
          file=sys.stderr,
      )
      return 2
    print(f"linen-moe {linen_moe.__version__}")
    return 0
  args = _parse(argv)
  args.argv = argv
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
# is most of what `matrix` (a few steps of each of 216 cells) does.
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
