"""A run on the user's files (`RunOptions(data=..., tokenizer=...,
packing=..., eval_every=...)`): rows packed first fit, the tokenizer of a
Hugging Face start, a fine-tune whose held-out loss falls, and bad input,
a `ValueError` naming the field before any step. Resuming such a run:
test_data_resume.py."""

from __future__ import annotations

import math
import os
import pathlib
import shutil

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe import data
from linen_moe import testing
from linen_moe import training
from linen_moe._src.run import sources
from linen_moe._src.testing import helpers
from tests import corpus_fixture

MIXTRAL = (
    pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "mixtral_gqa_swa"
)


def _quiet(opts: training.RunOptions) -> training.RunResult:
  return training.run(opts, log=lambda _: None)


@testing.slow
class FirstFitTest(corpus_fixture.CorpusTestCase):

  def test_first_fit_rows_train_with_segments(self):
    # Two steps of two microbatches and one held-out loss, on rows packed
    # first fit: the fill is reported, the losses are finite.
    result, logged = self.train(
        self.tempdir(), 2, eval_every=2, packing="first_fit"
    )
    (fill,) = [x for x in logged if x.startswith("packing first_fit: ")]
    self.assertRegex(fill, r"^packing first_fit: \d+\.\d% of positions hold")
    self.assertTrue(any(x.startswith("step 2: held-out loss ") for x in logged))
    self.assertLen(result.losses, 2)
    self.assertTrue(all(math.isfinite(x) for x in result.losses))
    ((step, held_out),) = result.eval_losses
    self.assertEqual(step, 2)
    self.assertTrue(math.isfinite(held_out))


class BadInputTest(corpus_fixture.CorpusTestCase):
  """Each bad input is a one-line `ValueError` naming the field and the
  file, before any step (no metrics row, no checkpoint)."""

  def test_bad_files_before_any_step(self):
    tmp = self.tempdir()
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    open(os.path.join(empty, "a.txt"), "w").close()
    short = os.path.join(tmp, "short.txt")
    with open(short, "w") as f:
      f.write("a few words")
    big = os.path.join(tmp, "big.json")
    data.train_bpe_tokenizer(testing.license_texts()[:3], 300, big)
    corrupt = os.path.join(tmp, "corrupt.json")
    with open(corrupt, "w") as f:
      f.write('{"version": "1.0", "model":')
    ids = os.path.join(tmp, "ids.npy")
    np.save(ids, np.array([1, 2, 256, 3], np.int32))
    cases = [
        ({"data": os.path.join(tmp, "none.txt")}, "none.txt: no such file"),
        ({"data": empty}, "a.txt: the corpus is empty"),
        ({"data": short}, r"short.txt: the corpus has \d tokens, fewer than"),
        ({"tokenizer": big}, "big.json: its vocabulary of 300 tokens is"),
        ({"tokenizer": corrupt}, "corrupt.json: cannot be read as a tok"),
        ({"data": ids}, r"ids.npy: id 256 at position 2 is outside \[0, "),
    ]
    for changes, message in cases:
      (field,) = changes
      with self.subTest(message=message):
        directory = os.path.join(tmp, "run")
        with self.assertRaisesRegex(
            ValueError, f"^{field} .*{message}"
        ) as raised:
          self.train(directory, 2, **changes)
        self.assertNotIn("\n", str(raised.exception))
        self.assertFalse(os.path.exists(os.path.join(directory, "1")))
        self.assertFalse(
            os.path.exists(os.path.join(directory, "metrics.jsonl"))
        )

  def test_bad_options(self):
    # `RunOptions` refuses them at construction, before jax.
    for fields, message in (
        ({"eval_every": 2}, r"^eval_every=2 is invalid: it needs `data`"),
        ({"tokenizer": "t.json"}, r"^tokenizer='t.json' is invalid: .*`data`"),
        (
            {"data": self.corpus, "eval_every": 2, "eval_fraction": 0},
            r"^eval_every=2 is invalid: `eval_fraction` 0 holds none",
        ),
        (
            {"data": self.corpus, "data_dtype": "uint16", "data_format": "npy"},
            r"^data_dtype='uint16' is invalid: only 'bin'",
        ),
    ):
      with self.assertRaisesRegex(ValueError, message):
        training.RunOptions(**fields)


class _HfCheckpoint(corpus_fixture.CorpusTestCase):
  """A copy of the Mixtral fixture (vocab 64) with a tokenizer.json of 64
  tokens trained on the corpus."""

  def hf_dir(self, with_tokenizer: bool = True) -> str:
    directory = os.path.join(self.tempdir(), "mixtral")
    shutil.copytree(MIXTRAL, directory)
    if with_tokenizer:
      path = os.path.join(directory, "tokenizer.json")
      data.train_bpe_tokenizer(testing.license_texts(), 64, path)
    return directory


class InitFromHfTokenizerTest(_HfCheckpoint):
  """`init_from_hf` DIR tokenizes with DIR/tokenizer.json unless
  `tokenizer` names another."""

  def test_the_checkpoints_tokenizer(self):
    directory = self.hf_dir()
    opts = training.RunOptions(init_from_hf=directory, data=self.corpus)
    self.assertEqual(
        sources.tokenizer_path(opts),
        os.path.join(directory, "tokenizer.json"),
    )
    opts = training.RunOptions(
        init_from_hf=directory, data=self.corpus, tokenizer=self.tokenizer
    )
    self.assertEqual(sources.tokenizer_path(opts), self.tokenizer)
    bare = training.RunOptions(
        init_from_hf=self.hf_dir(False), data=self.corpus
    )
    self.assertIsNone(sources.tokenizer_path(bare))
    # The run's own 256-token tokenizer does not fit the fixture's 64.
    with self.assertRaisesRegex(
        ValueError, "^tokenizer .*larger than the model's vocab_size=64"
    ):
      _quiet(
          training.RunOptions(
              init_from_hf=directory,
              data=self.corpus,
              tokenizer=self.tokenizer,
              steps=1,
          )
      )
    with self.assertRaisesRegex(ValueError, "^data .*: text needs a tokenizer"):
      _quiet(
          training.RunOptions(
              init_from_hf=self.hf_dir(False), data=self.corpus, steps=1
          )
      )


@testing.slow
class FineTuneHfTest(_HfCheckpoint):

  def test_held_out_loss_falls(self):
    """The Mixtral fixture fine-tuned on the corpus with its own tokenizer:
    the held-out loss falls."""
    directory = self.hf_dir()
    run = os.path.join(self.tempdir(), "run")
    result = _quiet(
        training.RunOptions(
            init_from_hf=directory,
            data=self.corpus,
            steps=40,
            batch_size=8,
            seq_len=32,
            learning_rate=3e-3,
            eval_every=5,
            eval_batches=2,
            checkpoint_dir=run,
            progress=False,
        )
    )
    held_out = [
        r["eval_loss"] for r in helpers.run_metrics(run) if "eval_loss" in r
    ]
    self.assertLen(held_out, 8)
    self.assertEqual([loss for _, loss in result.eval_losses], held_out)
    self.assertLess(held_out[-1], held_out[0] - 0.5, held_out)
    with checkpoint.Checkpoints(run) as ckpts:
      corpus = ckpts.meta()["data"]["pipeline"]["corpus"]
    self.assertEqual(
        corpus["tokenizer"], os.path.join(directory, "tokenizer.json")
    )


if __name__ == "__main__":
  absltest.main()
