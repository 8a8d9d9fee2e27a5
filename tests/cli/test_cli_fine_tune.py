"""`linen-moe train` as a person reads it: a run in its default directory,
its banner, a line per N steps, its labelled summary, and its one-line
errors for `--init-from` and for a resume with another rate (naming the
flags). The recipe a start picks and a new run from another's weights
(`init_from`): tests/run/test_init_from.py; the step lines themselves:
tests/run/test_step_lines.py."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest

from linen_moe._src.testing import helpers
from tests import cli_helpers

SHAPE = ["--batch-size", "2", "--seq-len", "8"]
TINY = ["--set", "num_layers=1", *SHAPE]


class InitFromFlagTest(absltest.TestCase):

  def test_init_from_a_directory_without_a_checkpoint(self):
    err = cli_helpers.cli_error("train", "--init-from", helpers.tempdir(self))
    self.assertRegex(err, r"^linen-moe: error: init_from=.* \(--init-from\)")
    self.assertIn("holds no checkpoint", err)
    self.assertEqual(len(err.strip().splitlines()), 1)


class DefaultDirectoryTest(absltest.TestCase):
  """One tiny run in its default directory: what the command prints."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.runs = tempfile.mkdtemp(prefix="linen_moe_runs-")
    cls.addClassCleanup(shutil.rmtree, cls.runs, ignore_errors=True)
    with mock.patch.dict(os.environ, {"LINEN_MOE_RUNS_DIR": cls.runs}):
      cls.status, cls.out, cls.err = cli_helpers.cli(
          "train", "--steps", "5", "--log-every", "2", "--no-progress", *TINY
      )

  def test_default_directory_banner_lines_and_summary(self):
    self.assertEqual(self.status, 0, self.err)
    where = re.search(r"^run directory: (\S+) ", self.out, re.M)[1]
    self.assertEqual(os.path.dirname(where), self.runs)
    self.assertRegex(os.path.basename(where), r"^tiny_mixtral-\d{8}-\d{6}$")
    rows = helpers.read_jsonl(os.path.join(where, "metrics.jsonl"))
    self.assertEqual([r["step"] for r in rows], [1, 2, 3, 4, 5])  # saved there
    for text in (
        "linen-moe train: tiny_mixtral (num_layers=1), scratch recipe",
        "  Hugging Face: exports as mixtral",
        "  devices: 1 cpu",
        "  data: synthetic Markov tokens (seed 1)",
        (
            "  steps 1-5, batch 2 x 8 tokens (80 in all), learning rate 0.01 "
            "(constant), weight decay 0"
        ),
    ):
      self.assertIn(text, self.out)
    counts = re.search(
        r"parameters: ([\d.]+) M total, ([\d.]+) M active a token, "
        r"([\d.]+) M trainable",
        self.out,
    )
    total, active, trainable = map(float, counts.groups())
    self.assertLess(active, total)  # 2 of 8 experts a token
    self.assertEqual(trainable, total)
    steps = re.findall(r"^step (\d+)/5: loss ", self.out, re.M)
    self.assertEqual(steps, ["1", "2", "4", "5"])
    self.assertRegex(
        self.out, r"final loss: \d+\.\d{4} \(mean of the last 5 steps\)"
    )

  def test_a_resume_with_another_rate_names_the_flags(self):
    source = re.search(r"^run directory: (\S+) ", self.out, re.M)[1]
    err = cli_helpers.cli_error(
        "train",
        "--checkpoint-dir",
        source,
        "--steps",
        "6",
        "--learning-rate",
        "1e-30",
        *TINY,
    )
    self.assertIn(f"--init-from {source} and a new --checkpoint-dir", err)
    self.assertEqual(len(err.strip().splitlines()), 1)


if __name__ == "__main__":
  absltest.main()
