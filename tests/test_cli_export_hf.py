"""`linen-moe export --format hf` of every shipped config named after a
Hugging Face family, and the config list of `--help` that says which
configs export (`linen_moe.hf.family_match`: tests/test_hf_family_match.py).
"""

import contextlib
import io

from absl.testing import absltest

from linen_moe_cli import main as cli
from linen_moe_cli import model_args
from tests.test_hf_family_match import EXPORTED


class ConfigListTest(absltest.TestCase):

  def test_help_marks_the_configs_that_export(self):
    listed = model_args.config_list()
    for name, model_type in EXPORTED.items():
      self.assertIn(f"{name} [hf: {model_type}]", listed)
    self.assertIn(
        "tiny_deepseek_v3 [no HF form: 2 fields differ from deepseek_v3]",
        listed,
    )
    self.assertIn(
        "tiny_gemma4_26b [no HF form: 8 fields differ from gemma4_text]",
        listed,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as done:
      cli.main(["train", "--help"])
    self.assertEqual(done.exception.code, 0)
    self.assertIn(
        "tiny_mixtral [hf: mixtral]", " ".join(out.getvalue().split())
    )


if __name__ == "__main__":
  absltest.main()
