"""Every entry point names the families the loader reads, from one table
(`linen_moe._src.hf.families.SUPPORTED_FAMILIES`): the README's intro and
checkpoint section, `train --help`'s `--init-from-hf`, `export --help`'s
adapters (which families' experts PEFT's files hold), `linen_moe.hf`'s
docstring, the command-line and Hugging Face guides, and layer.md's table
of the shipped configs; the README lists every guide; a hub name given
for a folder says how to download it."""

import json
import os
import pathlib
import re

from absl.testing import absltest

from linen_moe import available_configs
from linen_moe import hf
from linen_moe._src.hf import config_map
from linen_moe._src.hf.families import SUPPORTED_FAMILIES
from linen_moe.training import RunOptions
from tests import cli_helpers

# CI runs the suite from a copy of tests/ with README.md and docs/ beside it.
_ROOT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir
)
_FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
NAMES = [f.name for f in SUPPORTED_FAMILIES]


def _read(page: str) -> str:
  with open(os.path.join(_ROOT, page), encoding="utf-8") as f:
    return f.read()


def _between(text: str, start: str, end: str) -> str:
  """The text from `start` up to the next `end` after it, on one line."""
  head = text.index(start)
  return " ".join(text[head : text.index(end, head + len(start))].split())


def _help(*argv: str) -> str:
  return " ".join(cli_helpers.cli_output(*argv, "--help").split())


class FamilyTableTest(absltest.TestCase):

  def assert_names_all(self, text: str, where: str) -> None:
    missing = [n for n in NAMES if n not in text]
    self.assertFalse(missing, f"{where} does not name {missing}")

  def test_the_table_is_what_the_loader_reads(self):
    self.assertLen(NAMES, 8)
    self.assertLen(set(NAMES), 8)
    types = [t for f in SUPPORTED_FAMILIES for t in f.model_types]
    self.assertCountEqual(types, config_map.FAMILIES)
    # The checkpoints transformers wrote (tests/fixtures/hf) are of those
    # model types, every one.
    written = {
        json.loads(path.read_text())["model_type"]
        for path in _FIXTURES.glob("*/config.json")
    }
    self.assertEqual(written, set(types))
    self.assertEqual(
        [f.name for f in SUPPORTED_FAMILIES if not f.peft_experts],
        ["GPT-OSS", "Llama-4"],
    )

  def test_readme(self):
    readme = _read("README.md")
    self.assert_names_all(
        _between(readme, "It routes the way", "## "), "the README's intro"
    )
    self.assertIn("tiny configs of those eight families", " ".join(
        readme.split()))  # fmt: skip
    section = _between(readme, "## Hugging Face checkpoints", "\n## ")
    self.assert_names_all(section, "the README's checkpoint section")
    self.assertIn("hf download", section)

  def test_help(self):
    train = _between(_help("train"), "--init-from-hf DIR", " --init-from ")
    self.assert_names_all(train, "train --help's --init-from-hf")
    self.assertIn("hf download NAME --local-dir DIR", train)
    # export --help: whose adapters PEFT's files hold whole, whose not.
    adapters = _between(_help("export"), "adapters: a LoRA run's", " --dtype")
    whole = _between(adapters, "every adapter for", ";")
    partial = _between(adapters, "; for", "all but the routed experts'")
    for family in SUPPORTED_FAMILIES:
      with self.subTest(family=family.name):
        self.assertEqual(family.name in whole, family.peft_experts)
        self.assertEqual(family.name in partial, not family.peft_experts)

  def test_hf_docstring(self):
    self.assert_names_all(hf.__doc__.split("\n\n")[0], "linen_moe.hf's")
    peft = _between(hf.__doc__, "`save_peft_adapters` writes", "(`linen-moe")
    whole = _between(peft, "all of them for", ";")
    for family in SUPPORTED_FAMILIES:
      with self.subTest(family=family.name):
        self.assertEqual(family.name in whole, family.peft_experts)

  def test_guides(self):
    cli = _read("docs/guides/cli.md")
    self.assert_names_all(
        _between(cli, "`--init-from-hf DIR` fine-tunes", "```"), "cli.md"
    )
    hf_md = _read("docs/guides/hf.md")
    for family in SUPPORTED_FAMILIES:
      with self.subTest(family=family.name):
        self.assertRegex(hf_md, rf"\n\| {re.escape(family.name)}[ /(]")
    self.assertIn("hf download", hf_md)
    # layer.md's table of the shipped configs names every one.
    table = _between(_read("docs/guides/layer.md"), "| name | what |", "\n\n")
    listed = set(re.findall(r"`(\w+)`", table))
    self.assertFalse(set(available_configs()) - listed)

  def test_readme_lists_every_guide(self):
    docs = _between(_read("README.md"), "## Documentation", "\n## ")
    guides = sorted(os.listdir(os.path.join(_ROOT, "docs", "guides")))
    self.assertIn("new_families.md", guides)
    missing = [g for g in guides if f"(docs/guides/{g})" not in docs]
    self.assertFalse(missing, f"the README's guide list lacks {missing}")

  def test_a_hub_name_says_how_to_download_it(self):
    want = "`hf download openai/gpt-oss-20b --local-dir DIR`"
    with self.assertRaisesRegex(ValueError, r"init_from_hf.*does not ex"):
      RunOptions(init_from_hf="openai/gpt-oss-20b")
    try:
      RunOptions(init_from_hf="openai/gpt-oss-20b")
    except ValueError as e:
      self.assertIn(want, str(e))
    with self.assertRaisesRegex(ValueError, re.escape(want)):
      hf.load_checkpoint("openai/gpt-oss-20b")


if __name__ == "__main__":
  absltest.main()
