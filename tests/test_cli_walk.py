"""What a new user reads says what works: the README, the guides and every
command's --help name install commands that run as written and examples
that the command accepts (a walk through them, issue 62)."""

import glob
import os
import sys
from unittest import mock

from absl.testing import absltest

from linen_moe_cli import options
from linen_moe_cli.commands import train as train_command
from tests import cli_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every command and subcommand a user can ask for --help.
COMMANDS = (
    (),
    ("train",),
    ("export",),
    ("matrix",),
    ("launch",),
    ("generate",),
    ("plan",),
    ("tokenizer",),
    ("tokenizer", "train"),
)


def helps() -> dict[str, str]:
  """`linen-moe ... --help` of every command, by its command line."""
  out = {}
  for command in COMMANDS:
    status, text, err = cli_helpers.cli(*command, "--help")
    assert status == 0, (command, err)
    out[" ".join(("linen-moe", *command, "--help"))] = text
  return out


def pages() -> dict[str, str]:
  """The README and every page of docs/, by path."""
  paths = [
      "README.md",
      *glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True),
  ]
  out = {}
  for path in paths:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      out[path] = f.read()
  return out


class InstallHintsTest(absltest.TestCase):
  """The package is on no index: `pip install 'linen_moe[EXTRA]'` cannot
  work, from a checkout `pip install '.[EXTRA]'` does."""

  def test_no_hint_installs_from_an_index(self):
    for name, text in {**pages(), **helps()}.items():
      self.assertNotIn("linen_moe[", text, name)
      self.assertNotIn("linen-moe[", text, name)

  def test_missing_extra_names_the_checkout_and_the_package(self):
    missing = ModuleNotFoundError(
        "No module named 'tensorboardX'", name="tensorboardX"
    )
    with (
        mock.patch.object(train_command, "run", side_effect=missing),
        mock.patch.dict(sys.modules, {"tensorboardX": None}),  # not importable
    ):
      status, _, err = cli_helpers.cli("train")
    self.assertEqual(status, 2)
    self.assertEqual(
        err,
        "linen-moe: error: tensorboardX is not installed, so this command"
        " stops; install it with pip install '.[tensorboard]' from a checkout"
        " (or scripts/setup_venv.sh tensorboard), else pip install"
        " tensorboardX.\n",
    )
    self.assertEqual(options.EXTRAS["tensorboardX"], "tensorboard")


if __name__ == "__main__":
  absltest.main()
