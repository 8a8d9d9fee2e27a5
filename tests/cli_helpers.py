"""What the command line's tests share: running `linen-moe` in this process,
and the command lines of a local process group."""

from __future__ import annotations

from absl.testing import absltest

from linen_moe import testing
from linen_moe._src.parallel import launcher
from linen_moe_cli import main as cli_main
from linen_moe_cli.commands import launch


def cli(*argv: str) -> tuple[int, str, str]:
  """(exit status, stdout, stderr) of `linen-moe argv`, run in this
  process (argparse's exits, for --help or a bad flag, included)."""

  def main(args):
    try:
      return cli_main.main(args)
    except SystemExit as e:
      return e.code

  return testing.run_capturing(main, list(argv))


def cli_output(*argv: str) -> str:
  """The stdout of `linen-moe argv`, which must succeed."""
  status, out, err = cli(*argv)
  if status:
    raise AssertionError(f"linen-moe {' '.join(argv)} exited {status}: {err}")
  return out


def cli_error(*argv: str) -> str:
  """The stderr of `linen-moe argv`, which must fail on its input (exit 2)."""
  status, _, err = cli(*argv)
  if status != 2:
    raise AssertionError(f"linen-moe {' '.join(argv)} exited {status}")
  return err


def train_commands(argv: list[str], processes: int) -> list[list[str]]:
  """The command line of each of `processes` local processes of
  `linen-moe train` (`argv` starts with "train"), as `linen-moe launch`
  runs them (`linen_moe.distributed.launch`'s process flags appended)."""
  base = launch.train_command(argv)
  return [base + flags for flags in launcher.process_flags(processes)]


def as_started_for(
    test: absltest.TestCase, rows: list[dict], started: int, steps: int
) -> list[dict]:
  """The metrics rows of a run started for `started` steps and resumed,
  with the steps its first row records (checked: `started`) set to
  `steps`, to compare with a run started for `steps`."""
  test.assertEqual(rows[0]["recipe"]["steps"], started)
  rows[0]["recipe"]["steps"] = steps
  return rows
