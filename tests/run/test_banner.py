"""The run's start banner: what it says of the model's Hugging Face form
before any training."""

import re

from absl.testing import absltest

from linen_moe import hf
from linen_moe import load_model_config
from linen_moe._src.run import banner


class FamilyLineTest(absltest.TestCase):

  def test_exporting_config(self):
    line = banner._family_line(load_model_config("tiny_mixtral"))
    self.assertEqual(line, "  Hugging Face: exports as mixtral")

  def test_no_form_names_the_shipped_configs_that_export(self):
    line = banner._family_line(load_model_config("tiny_deepseek_v3"))
    self.assertStartsWith(
        line, "  Hugging Face: no form (the nearest family, deepseek_v3, needs "
    )
    named = re.search(r"shipped configs that export as it: ([^)]*)\)$", line)
    self.assertIsNotNone(named, line)
    names = named[1].split(", ")
    # The MLA sibling the tests train and the full-size config.
    self.assertContainsSubset(
        {"tiny_deepseek_v3_mla", "deepseek_v3_671b"}, names
    )
    for name in names:
      match = hf.family_match(load_model_config(name))
      self.assertTrue(match.exports, name)
      self.assertEqual(match.model_type, "deepseek_v3", name)


if __name__ == "__main__":
  absltest.main()
