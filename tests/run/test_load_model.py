"""`decoding.load_model`: a Hugging Face folder's or a run's model with its
tokenizer and stop ids, in one call (issue 64, item 3). A run directory's
tokenizer files and stop id: tests/cli/test_cli_tokenizer.py."""

import json
import pathlib
import shutil

from absl.testing import absltest
import jax
import numpy as np
from tokenizers import Tokenizer

from linen_moe import decoding
from linen_moe import hf
from linen_moe._src.testing import helpers

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
MIXTRAL = FIXTURES / "hf" / "mixtral_gqa_swa"
TOKENIZER = FIXTURES / "chat" / "mixtral" / "tokenizer.json"


class LoadModelTest(absltest.TestCase):

  def test_a_hugging_face_folder_with_its_tokenizer_and_stop_ids(self):
    folder = pathlib.Path(helpers.tempdir(self)) / "model"
    shutil.copytree(MIXTRAL, folder)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7]})
    )
    model = decoding.load_model(folder)
    config, variables = hf.load_checkpoint(MIXTRAL)
    self.assertEqual(model.config, config)
    for got, want in zip(
        jax.tree.leaves(model.variables),
        jax.tree.leaves(variables),
        strict=True,
    ):
      np.testing.assert_array_equal(got, want)
    self.assertEqual(model.stop_ids, (2, 7))
    self.assertEqual(model.tokenizer_path, str(folder / "tokenizer.json"))
    self.assertEqual(
        model.tokenizer.to_str(), Tokenizer.from_file(str(TOKENIZER)).to_str()
    )
    self.assertIsNone(model.step)
    served = decoding.load_model(MIXTRAL, serve="int8")
    self.assertEqual(
        (served.config.moe.quantization, served.stop_ids), ("int8", ())
    )
    self.assertTrue(served.config.moe.serving)
    self.assertIsNone(served.tokenizer)

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "is not a directory"):
      decoding.load_model(MIXTRAL / "nowhere")
    with self.assertRaisesRegex(ValueError, r"serve='int4' is invalid"):
      decoding.load_model(MIXTRAL, serve="int4")
    with self.assertRaisesRegex(ValueError, "no such file"):
      decoding.load_model(MIXTRAL, tokenizer=MIXTRAL / "tokenizer.json")


if __name__ == "__main__":
  absltest.main()
