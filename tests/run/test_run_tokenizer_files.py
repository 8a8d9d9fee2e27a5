"""What a run keeps of its tokenizer (`_src/run/tokenizer_files.py`,
`tokenizer_files.kept_files`), file by file; the command line's use of it is in
tests/cli/test_cli_tokenizer.py."""

import json
import os
import pathlib

from absl.testing import absltest

from linen_moe import data
from linen_moe import hf
from linen_moe import testing
from linen_moe._src.run import tokenizer_files
from linen_moe._src.testing import helpers
from linen_moe.training import RunOptions

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"


class KeepTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = pathlib.Path(helpers.tempdir(self))
    self.tokenizer = str(self.tmp / "tokenizer.json")
    data.train_bpe_tokenizer(testing.license_texts()[:2], 64, self.tokenizer)

  def test_a_lone_tokenizer_and_its_end_of_document_id(self):
    run = self.tmp / "run"
    run.mkdir()
    opts = RunOptions(checkpoint_dir=str(run))
    written = tokenizer_files.keep(opts, self.tokenizer)
    self.assertEqual(
        sorted(os.path.basename(p) for p in written),
        ["generation_config.json", "tokenizer.json", "tokenizer_config.json"],
    )
    kept = tokenizer_files.kept_files(run)
    self.assertEqual(kept.generation_config, {"eos_token_id": 0})
    self.assertEqual(kept.tokenizer, str(run / "tokenizer.json"))
    # `--eod-id` is the stop id when given.
    opts = RunOptions(
        checkpoint_dir=str(run), data=testing.license_texts()[0], eod_id=1
    )
    tokenizer_files.keep(opts, self.tokenizer)
    self.assertEqual(tokenizer_files.kept_files(run).stop_ids, [1])
    # Another process of the group writes nothing.
    other = self.tmp / "other"
    other.mkdir()
    opts = RunOptions(checkpoint_dir=str(other))
    self.assertEqual(tokenizer_files.keep(opts, self.tokenizer, False), [])
    self.assertEqual(os.listdir(other), [])

  def test_the_starting_checkpoints_generation_config(self):
    # Its generation_config.json is kept, with the tokenizer's stop id
    # where it names none.
    start = self.tmp / "start"
    start.mkdir()
    (start / "config.json").write_text(
        (FIXTURES / "mixtral_gqa_swa" / "config.json").read_text()
    )
    (start / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 5, "do_sample": True})
    )
    run = self.tmp / "run"
    run.mkdir()
    opts = RunOptions(checkpoint_dir=str(run), init_from_hf=str(start))
    tokenizer_files.keep(opts, self.tokenizer)
    self.assertEqual(
        tokenizer_files.kept_files(run).generation_config,
        {"bos_token_id": 5, "do_sample": True, "eos_token_id": 0},
    )
    # Without a tokenizer, the checkpoint's alone (no tokenizer files).
    (start / "generation_config.json").write_text('{"eos_token_id": [2, 3]}')
    bare = self.tmp / "bare"
    bare.mkdir()
    opts = RunOptions(checkpoint_dir=str(bare), init_from_hf=str(start))
    tokenizer_files.keep(opts, None)
    kept = tokenizer_files.kept_files(bare)
    self.assertEqual((kept.tokenizer, kept.stop_ids), (None, [2, 3]))

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, r"nowhere does not exist"):
      tokenizer_files.kept_files(self.tmp / "nowhere")
    run = self.tmp / "run"
    run.mkdir()
    (run / "generation_config.json").write_text("[1, 2]")
    with self.assertRaisesRegex(ValueError, r"is not a JSON object"):
      tokenizer_files.kept_files(run)
    (run / "generation_config.json").write_text("{")
    with self.assertRaisesRegex(ValueError, r"cannot be read"):
      tokenizer_files.kept_files(run)


class SaveCheckpointExtrasTest(absltest.TestCase):

  def test_bad_extras(self):
    config, variables = hf.load_checkpoint(FIXTURES / "mixtral_gqa_swa")
    tmp = pathlib.Path(helpers.tempdir(self))
    with self.assertRaisesRegex(
        ValueError, r"generation_config=\[0\] is invalid: expected a mapping"
    ):
      hf.save_checkpoint(config, variables, tmp / "a", generation_config=[0])
    with self.assertRaisesRegex(
        ValueError, r"tokenizer_files: .*none.json does not exist"
    ):
      hf.save_checkpoint(
          config, variables, tmp / "b", tokenizer_files=[tmp / "none.json"]
      )
    clash = tmp / "config.json"
    clash.write_text("{}")
    with self.assertRaisesRegex(
        ValueError, r"would overwrite the checkpoint's config.json"
    ):
      hf.save_checkpoint(config, variables, tmp / "c", tokenizer_files=[clash])
    self.assertFalse(any((tmp / n).exists() for n in "abc"))


if __name__ == "__main__":
  absltest.main()
