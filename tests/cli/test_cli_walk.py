"""What a new user reads says what works: the README, the guides and every
command's --help name install commands that run as written and examples
that the command accepts (a walk through them, issue 62)."""

import argparse
import glob
import os
import re
import sys
from unittest import mock

from absl.testing import absltest

import linen_moe
from linen_moe import testing
from linen_moe._src.testing import helpers
from linen_moe_cli import main as cli_main
from linen_moe_cli import options
from linen_moe_cli.commands import train as train_command
from tests import cli_helpers

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
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


def _parsers():
  """(command line, parser) of every command and subcommand."""
  todo = [("linen-moe", cli_main.build_parser())]
  while todo:
    name, parser = todo.pop()
    yield name, parser
    for action in parser._actions:  # noqa: SLF001 (argparse has no public way)
      if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
        todo += [(f"{name} {n}", p) for n, p in action.choices.items()]


class HelpTest(absltest.TestCase):

  def test_every_option_says_what_it_does_and_one_default(self):
    for name, parser in _parsers():
      formatter = cli_main.DefaultsHelp(name)
      for action in parser._actions:  # noqa: SLF001
        if not action.option_strings or action.help == argparse.SUPPRESS:
          continue
        flag = f"{name} {action.option_strings[0]}"
        self.assertTrue(action.help, flag)
        shown = formatter._get_help_string(action)  # noqa: SLF001
        shown = shown.replace("%(default)s", "X")
        self.assertLessEqual(shown.count("default"), 1, (flag, shown))

  def test_remat_lists_its_policies(self):
    for command in ("train", "plan"):
      text = " ".join(cli_helpers.cli_output(command, "--help").split())
      entry = text[text.index("--remat", text.index("options:")) :]
      entry = entry[: entry.index(" --", 3)]
      for policy in linen_moe.ModelConfig.REMAT_POLICIES:
        self.assertIn(policy, entry, command)

  def test_matrix_all_names_its_configs(self):
    text = " ".join(cli_helpers.cli_output("matrix", "--help").split())
    for config in (*testing.TINY_CONFIGS, *testing.FAMILY_CONFIGS):
      self.assertIn(config, text[text.index("--all") :])


class InstallHintsTest(absltest.TestCase):
  """The package is on no index: `pip install 'linen_moe[EXTRA]'` cannot
  work, from a checkout `pip install '.[EXTRA]'` does."""

  def test_no_hint_installs_from_an_index(self):
    for name, text in {**pages(), **helps()}.items():
      self.assertNotIn("linen_moe[", text, name)
      self.assertNotIn("linen-moe[", text, name)

  def test_no_message_of_the_package_installs_from_an_index(self):
    # Every error and log line lives in the installed package's sources.
    roots = [os.path.dirname(linen_moe.__file__)]
    roots.append(os.path.dirname(cli_main.__file__))
    for root in roots:
      for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
          self.assertNotIn("'linen_moe[", f.read(), path)

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


class ChatTokenizerHintTest(absltest.TestCase):

  def test_a_tokenizer_without_template_says_what_to_add(self):
    # `tokenizer train` writes a lone tokenizer.json; chat data needs more.
    folder = helpers.tempdir(self)
    text = os.path.join(folder, "notes.txt")
    with open(text, "w", encoding="utf-8") as f:
      f.write("What is 2 + 2? Four. " * 20)
    tokenizer = os.path.join(folder, "tokenizer.json")
    cli_helpers.cli_output(
        "tokenizer", "train", text, "--vocab-size", "64", "--out", tokenizer
    )
    chats = os.path.join(folder, "chats.jsonl")
    with open(chats, "w", encoding="utf-8") as f:
      f.write(
          '{"messages": [{"role": "user", "content": "Hi"},'
          ' {"role": "assistant", "content": "Hello"}]}\n'
      )
    err = cli_helpers.cli_error(
        "train", "--data", chats, "--data-format", "chat",
        "--tokenizer", tokenizer, "--checkpoint-dir",
        os.path.join(folder, "run"),
    )  # fmt: skip
    self.assertEqual(err.count("\n"), 1, err)
    self.assertIn(
        f"tokenizer folder {folder}: has no tokenizer_config.json;", err
    )
    self.assertIn('tokenizer.json with the "chat_template"', err)
    self.assertIn('("eos_token", ...)', err)


class ExportIsNoRunTest(absltest.TestCase):

  def test_generate_on_an_export_says_what_it_is(self):
    # `linen-moe export --out DIR` writes one orbax checkpoint (its marker
    # file at the top), not a run's folder of steps.
    export = helpers.tempdir(self)
    with open(os.path.join(export, "_CHECKPOINT_METADATA"), "w") as f:
      f.write("{}")
    err = cli_helpers.cli_error(
        "generate", "--checkpoint-dir", export, "--prompt-ids", "1,2"
    )
    self.assertEqual(err.count("\n"), 1, err)
    self.assertIn(f"No checkpoint in {export}. It is one checkpoint,", err)
    self.assertIn("linen_moe.checkpoint.load_export reads it", err)
    empty = helpers.tempdir(self)
    err = cli_helpers.cli_error(
        "generate", "--checkpoint-dir", empty, "--prompt-ids", "1,2"
    )
    self.assertEqual(err, f"linen-moe: error: No checkpoint in {empty}.\n")


class YamlNumberTest(absltest.TestCase):

  def test_a_number_read_as_text_says_how_to_write_it(self):
    # PyYAML (YAML 1.1) reads `router_z_loss_weight: 1e-3` as a string.
    hint = r"\(a YAML file reads 1e-3 as text: write 1.0e-3\)\.$"
    for field, value in (
        ("router_z_loss_weight", "1e-3"),
        ("norm_eps", "1e-5"),
    ):
      with self.assertRaisesRegex(ValueError, f"{field}='{value}' .*{hint}"):
        linen_moe.load_model_config("tiny_mixtral", **{field: value})
    with self.assertRaisesRegex(ValueError, r"expected a number\.$"):
      linen_moe.load_model_config("tiny_mixtral", router_jitter="often")


def _outside_code(text: str) -> list[str]:
  """The lines of a page outside its fenced code blocks."""
  lines, fenced = [], False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced:
      lines.append(line)
  return lines


class PagesTest(absltest.TestCase):

  def test_one_title_a_page(self):
    for path, text in pages().items():
      if path == "docs/changelog.md":  # includes CHANGELOG.md
        continue
      titles = [t for t in _outside_code(text) if t.startswith("# ")]
      self.assertLen(titles, 1, path)

  def test_named_files_exist(self):
    # The packages' files from where they are installed; benchmarks/,
    # tests/ and docs/ from the checkout (what CI copies beside the tests).
    import linen_moe  # noqa: PLC0415

    packages = os.path.dirname(os.path.dirname(linen_moe.__file__))
    for path, text in pages().items():
      for name, top in re.findall(
          r"`((linen_moe|nnx_adapter|linen_moe_cli|benchmarks|tests|docs|_src)"
          r"/[\w./-]+)`",
          text,
      ):
        if name.startswith(("benchmarks/results/", "docs/_build/")):
          continue  # what a run or the docs build writes
        if top == "_src":  # the pages' short form of linen_moe/_src/
          where = os.path.join(packages, "linen_moe", name)
        elif top in ("linen_moe", "nnx_adapter", "linen_moe_cli"):
          where = os.path.join(packages, name)
        else:
          where = os.path.join(ROOT, name)
        self.assertTrue(os.path.exists(where), f"{path}: {name}")


if __name__ == "__main__":
  absltest.main()
