"""`linen-moe train --data`: what only the command does with the user's
files. An error names the flag (exit status 2, one line); the summary line
has the last held-out loss and its perplexity (and no best achievable
loss); a run on a corpus resumes from one process to two with the same
global batch (slow). What the run does with the files (resuming it exactly,
first-fit rows, its bad input, a fine-tune's held-out loss, the loss
chart): tests/run/test_data_*.py and tests/run/test_loss_chart.py.
"""

from __future__ import annotations

import io
import os
from unittest import mock

from absl.testing import absltest
import numpy as np

from linen_moe import testing
from linen_moe import training
from linen_moe._src.parallel import launcher as launch
from linen_moe._src.testing import helpers
from tests import cli_helpers
from tests import corpus_fixture

STOP, STEPS = corpus_fixture.STOP, corpus_fixture.STEPS
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


class FlagsTest(absltest.TestCase):

  def test_an_error_names_the_flag(self):
    # The field's error (tests/run/test_data_runs.py) in the flags' words.
    status, out, err = cli_helpers.cli("train", "--eval-every", "2")
    self.assertEqual(status, 2, out + err)
    self.assertRegex(
        err,
        r"^linen-moe: error: eval_every=2 \(--eval-every\) is invalid: it "
        r"needs --data",
    )
    self.assertEqual(err.count("\n"), 1, err)


class ResultLineTest(absltest.TestCase):

  def test_the_last_held_out_loss(self):
    result = training.RunResult(
        losses=[5.0, 4.0],
        best_loss=float("nan"),  # real data: unknown
        eval_losses=[(1, 4.75), (2, 4.5)],
    )
    with mock.patch.object(training, "run", return_value=result):
      status, out, err = cli_helpers.cli(
          "train", "--steps=2", "--checkpoint-dir", helpers.tempdir(self)
      )
    self.assertEqual(status, 0, err)
    # exp(4.5) = 90.0171...
    self.assertRegex(
        out,
        r"(?m)^steps: 1-2  first loss: 5.0000  final loss: 4.5000 \(mean of "
        r"the last 2 steps\)  held-out loss: 4.5000 \(perplexity 90.02\)  "
        r"skipped steps: 0  wall: ",
    )
    self.assertNotIn("best achievable", out)


def _argv(corpus: str, tokenizer: str, *extra: str) -> list[str]:
  """`linen-moe train` on the corpus: the options of
  `corpus_fixture.CorpusTestCase.options` as flags."""
  return [
      "train", "--set", "num_layers=1", "--batch-size", "4", "--seq-len",
      "16", "--grad-accum", "2", "--learning-rate", "3e-3", "--data", corpus,
      "--tokenizer", tokenizer, "--packing", "pad", "--eval-every", "4",
      "--eval-batches", "2", "--save-every", "6", *extra,
  ]  # fmt: skip


def _group(argv: list[str], processes: int, devices: int) -> str:
  out, err = io.StringIO(), io.StringIO()
  result = launch.run_group(
      cli_helpers.train_commands(argv, processes),
      dict(launch.child_env(devices), PYTHONPATH=ROOT),
      timeout_s=900,
      out=out,
      err=err,
  )
  if result.code:
    raise AssertionError(err.getvalue()[-4000:])
  return out.getvalue()


@testing.slow
class ProcessesResumeTest(corpus_fixture.CorpusTestCase):

  def test_resume_from_one_process_to_two(self):
    """Steps 1-6 on 1 process x 2 devices, 7-12 on 2 processes x 1 device
    (each reading half of each batch of 4), against 1-12 on 1 x 2."""
    tmp = self.tempdir()
    whole, split = os.path.join(tmp, "whole"), os.path.join(tmp, "split")
    argv = _argv(self.corpus, self.tokenizer, "--mesh", "data=2")
    for directory, steps, processes, devices in (
        (whole, STEPS, 1, 2),
        (split, STOP, 1, 2),
        (split, STEPS, 2, 1),
    ):
      out = _group(
          [*argv, "--steps", str(steps), "--checkpoint-dir", directory],
          processes,
          devices,
      )
    self.assertIn("resumed from step 6", out)
    written = os.listdir(os.path.join(split, "12", "data"))
    self.assertContainsSubset(
        {"process_0-of-2.json", "process_1-of-2.json"}, written
    )
    a, b = helpers.run_metrics(whole), helpers.run_metrics(split)
    self.assertEqual([r["step"] for r in b], list(range(1, STEPS + 1)))
    for key in ("cross_entropy", "eval_loss"):
      # Cross-process sums may add in another order: float32 rounding.
      np.testing.assert_allclose(
          [r.get(key, 0.0) for r in b], [r.get(key, 0.0) for r in a], rtol=2e-6
      )


if __name__ == "__main__":
  absltest.main()
