"""A run on your own text keeps what it needs: `linen-moe tokenizer train`
makes the tokenizer, `train --data --tokenizer` keeps it (with its stop id)
in the run directory, and `generate --checkpoint-dir RUN --prompt TEXT` and
`export --format hf` use them with no other flag.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import data
from linen_moe import decoding
from linen_moe import hf
from linen_moe import testing
from linen_moe._src.testing import helpers
from tests import cli_helpers

# Four one-document files: "hello world", then the end of the document.
DOCUMENT = "hello world"


def _error(test: absltest.TestCase, *argv: str) -> str:
  """The one-line error of a command line that fails with status 2."""
  code, out, err = cli_helpers.cli(*argv)
  test.assertEqual(code, 2, out + err)
  test.assertEqual(err.count("\n"), 1, err)
  return err


class TokenizerCommandTest(absltest.TestCase):

  def test_train_a_tokenizer(self):
    tmp = helpers.tempdir(self)
    out = os.path.join(tmp, "tokenizer.json")
    code, printed, err = cli_helpers.cli(
        "tokenizer", "train", *testing.license_texts()[:4], "--vocab-size",
        "128", "--out", out,
    )  # fmt: skip
    self.assertEqual(code, 0, err)
    self.assertRegex(printed, r"wrote .*tokenizer.json: 128 tokens from 4 ")
    self.assertIn("end of document (stop) id 0", printed)
    tokenizer = data.load_tokenizer(out, vocab_size=128)
    self.assertEqual(tokenizer.token_to_id("<|endoftext|>"), 0)
    text = "Permission is hereby granted"
    self.assertEqual(tokenizer.decode(tokenizer.encode(text).ids), text)

  def test_bad_input_is_one_line_before_training(self):
    tmp = helpers.tempdir(self)
    empty, exists = os.path.join(tmp, "empty.txt"), os.path.join(tmp, "t.json")
    with open(empty, "w") as f:
      f.write(" \n\n")
    open(exists, "w").close()
    text = testing.license_texts()[0]
    new = os.path.join(tmp, "new.json")
    for argv, message in (
        ([empty, "--out", new], r"empty.txt is empty: it holds no text"),
        ([text, "--out", exists], r"--out .*t.json exists; it is never over"),
        ([text + ".missing", "--out", new], r"\.missing does not exist"),
        (
            [tmp, "--out", new],
            r"is a folder; give its files \(e\.g\. .*\*\.txt",
        ),
        (
            [os.path.join(tmp, "*.txt"), "--out", new],
            r"\*\.txt does not exist \(a glob is not expanded here",
        ),
        (
            [text, "--out", os.path.join(tmp, "no", "t.json")],
            r"the folder .*no does not exist",
        ),
        (
            [text, "--out", new, "--vocab-size", "2"],
            r"vocab_size=2 \(--vocab-size\) is invalid: expected an integer "
            ">= 3",
        ),
    ):
      with self.subTest(message=message):
        size = [] if "--vocab-size" in argv else ["--vocab-size", "64"]
        err = _error(self, "tokenizer", "train", *argv, *size)
        self.assertRegex(err, f"^linen-moe: error: .*{message}")
        self.assertFalse(os.path.exists(new))

  def test_library_names_the_empty_file(self):
    tmp = helpers.tempdir(self)
    empty = os.path.join(tmp, "empty.txt")
    open(empty, "w").close()
    with self.assertRaisesRegex(
        ValueError, r"^train_bpe_tokenizer: .*empty.txt is empty"
    ):
      data.train_bpe_tokenizer([testing.license_texts()[0], empty], 64)
    with self.assertRaisesRegex(ValueError, r"files='a.txt' must be a non-e"):
      data.train_bpe_tokenizer("a.txt", 64)


class RunKeepsItsTokenizerTest(absltest.TestCase):
  """One run of tiny_mixtral (one layer) on four "hello world" documents,
  long enough to end every answer with the end-of-document id."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.corpus = os.path.join(cls.tmp, "corpus")
    os.makedirs(cls.corpus)
    for i in range(4):
      with open(os.path.join(cls.corpus, f"{i}.txt"), "w") as f:
        f.write(DOCUMENT)
    cls.tokenizer = os.path.join(cls.tmp, "tokenizer.json")
    files = sorted(os.path.join(cls.corpus, f) for f in os.listdir(cls.corpus))
    code, _, err = cli_helpers.cli(
        "tokenizer", "train", *files, "--vocab-size", "16", "--out",
        cls.tokenizer,
    )  # fmt: skip
    assert code == 0, err
    cls.run_dir = os.path.join(cls.tmp, "run")
    code, _, err = cli_helpers.cli(*cls.train_argv(cls.tokenizer))
    assert code == 0, err

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  @classmethod
  def train_argv(cls, *tokenizer: str) -> list[str]:
    flags = ["--tokenizer", tokenizer[0]] if tokenizer else []
    return [
        "train", "--set", "num_layers=1", "--steps", "40", "--batch-size",
        "4", "--seq-len", "8", "--no-progress", "--data", cls.corpus,
        "--checkpoint-dir", cls.run_dir, *flags,
    ]  # fmt: skip

  def test_the_run_directory_keeps_the_tokenizer_and_its_stop_id(self):
    kept = decoding.load_model(self.run_dir)
    self.assertTrue(
        filecmp.cmp(kept.tokenizer_path, self.tokenizer, shallow=False)
    )
    with open(os.path.join(self.run_dir, "tokenizer_config.json")) as f:
      self.assertEqual(
          json.load(f),
          {
              "tokenizer_class": "PreTrainedTokenizerFast",
              "eos_token": "<|endoftext|>",
          },
      )
    self.assertEqual(kept.generation_config, {"eos_token_id": 0})
    self.assertEqual(kept.stop_ids, (0,))
    self.assertEqual(
        sorted(os.path.basename(p) for p in kept.tokenizer_files),
        ["tokenizer.json", "tokenizer_config.json"],
    )

  def test_generate_reads_the_tokenizer_and_stops_at_the_stop_id(self):
    code, out, err = cli_helpers.cli(
        "generate", "--checkpoint-dir", self.run_dir, "--prompt", "hello",
        "--max-new-tokens", "12",
    )  # fmt: skip
    self.assertEqual(code, 0, err)
    new = json.loads(re.search(r"new ids: (\[.*\])", out).group(1))
    self.assertLess(len(new), 12)
    self.assertEqual(new[-1], 0)  # <|endoftext|>, then nothing
    self.assertIn("finish: stop", out)
    self.assertIn("text: world\n", out)

  def test_a_resumed_run_reads_the_kept_tokenizer(self):
    # No --tokenizer: the run reads its corpus with the kept one (it is
    # already at its last step, so nothing trains).
    code, out, err = cli_helpers.cli(*self.train_argv())
    self.assertEqual(code, 0, err)
    self.assertIn("is already at step 40", out + err)
    other = os.path.join(helpers.tempdir(self), "other.json")
    data.train_bpe_tokenizer(testing.license_texts()[:2], 16, other)
    err = _error(self, *self.train_argv(other))
    self.assertRegex(
        err,
        r"tokenizer .*other.json: .*run trained with another tokenizer, "
        r".*tokenizer.json; resume with that one \(leave out --tokenizer\)",
    )

  def test_export_hands_the_tokenizer_to_transformers(self):
    out = os.path.join(helpers.tempdir(self), "hf")
    old = os.umask(0o022)
    try:
      code, printed, err = cli_helpers.cli(
          "export", "--checkpoint-dir", self.run_dir, "--out", out, "--format",
          "hf",
      )  # fmt: skip
    finally:
      os.umask(old)
    self.assertEqual(code, 0, err)
    self.assertIn("generation_config.json, the tokenizer", printed)
    names = sorted(os.listdir(out))
    self.assertEqual(
        names,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ],
    )
    # As save_pretrained leaves them: readable by everyone.
    self.assertEqual(os.stat(out).st_mode & 0o777, 0o755)
    for name in names:
      self.assertEqual(os.stat(os.path.join(out, name)).st_mode & 0o777, 0o644)
    with open(os.path.join(out, "generation_config.json")) as f:
      self.assertEqual(json.load(f), {"eos_token_id": 0})
    with open(os.path.join(out, "config.json")) as f:
      self.assertEqual(json.load(f)["eos_token_id"], 0)
    self.assertTrue(
        filecmp.cmp(
            os.path.join(out, "tokenizer.json"), self.tokenizer, shallow=False
        )
    )
    # The weights read back give the run's logits.
    config, variables, _ = checkpoint.read_variables(self.run_dir)
    back_config, back = hf.load_checkpoint(out)
    tokens = jnp.asarray([[9, 11, 13, 9, 15, 12, 0, 9]])
    want, _ = jax.jit(Decoder(config).apply)(variables, tokens)
    got, _ = jax.jit(Decoder(back_config).apply)(back, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
