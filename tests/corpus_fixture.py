"""A corpus of text files and a tokenizer trained on it, for the runs on
real data: tests/run/test_data_*.py (`training.run`) and
tests/cli/test_cli_train_data.py (`linen-moe train --data` in a process
group)."""

from __future__ import annotations

import os
import shutil
import tempfile

from absl.testing import absltest

from linen_moe import data
from linen_moe import testing
from linen_moe import training
from linen_moe._src.testing import helpers

# A run stopped after step STOP and resumed to STEPS, against one run to
# STEPS.
STOP, STEPS = 6, 12


class CorpusTestCase(helpers.TempDirMixin, absltest.TestCase):
  """A test case whose class shares a corpus and its tokenizer, and the
  options of a small run on them.

  Attributes:
    corpus: a directory of the license texts (`linen_moe.testing.
      license_texts`), as 00.txt, 01.txt, ...
    tokenizer: a tokenizer.json of 256 tokens (the tiny configs'
      vocabulary) trained on them.
  """

  corpus: str
  tokenizer: str

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.corpus_tmp = tempfile.mkdtemp()
    cls.corpus = os.path.join(cls.corpus_tmp, "corpus")
    os.makedirs(cls.corpus)
    for i, path in enumerate(testing.license_texts()):
      shutil.copy(path, os.path.join(cls.corpus, f"{i:02d}.txt"))
    cls.tokenizer = os.path.join(cls.corpus_tmp, "tokenizer.json")
    data.train_bpe_tokenizer(testing.license_texts(), 256, cls.tokenizer)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.corpus_tmp, ignore_errors=True)
    super().tearDownClass()

  def options(
      self, directory: str, steps: int, **changes
  ) -> training.RunOptions:
    """A run on the corpus to `steps`, saved in `directory`: 1 layer,
    batches of 4 rows of 16 tokens in 2 microbatches, padded, a held-out
    loss of 2 batches every 4 steps, a save every 6; `changes` replace
    fields."""
    fields = dict(
        overrides={"num_layers": 1},
        batch_size=4,
        seq_len=16,
        grad_accum=2,
        learning_rate=3e-3,
        data=self.corpus,
        tokenizer=self.tokenizer,
        packing="pad",
        eval_every=4,
        eval_batches=2,
        save_every=6,
        progress=False,
        steps=steps,
        checkpoint_dir=directory,
    )
    return training.RunOptions(**{**fields, **changes})

  def train(
      self, directory: str, steps: int, frontend=None, **changes
  ) -> tuple[training.RunResult, list[str]]:
    """(`RunResult`, the lines it logged) of `training.run` of `options`
    with `frontend` (default Linen)."""
    logged = []
    result = training.run(
        self.options(directory, steps, **changes), frontend, log=logged.append
    )
    return result, logged
