"""A run a person reads and continues: the recipe of its start (scratch,
fine-tune, LoRA), its banner, a line per N steps in a log, its default
directory, its labelled summary, and a new run from its weights
(`--init-from`)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe._src.run import progress
from linen_moe._src.run import recipes
from linen_moe._src.testing import helpers
from linen_moe.training import RunOptions
from tests import cli_helpers

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
QWEN = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_moe_dense0_norm")
SHAPE = ["--batch-size", "2", "--seq-len", "8"]
TINY = ["--set", "num_layers=1", *SHAPE]


class RecipeTest(absltest.TestCase):
  """Which defaults a run gets, before jax."""

  def test_the_start_picks_the_recipe(self):
    scratch = RunOptions()
    self.assertEqual(scratch.recipe, recipes.SCRATCH)
    self.assertEqual(
        (scratch.steps, scratch.batch_size, scratch.seq_len),
        (200, 16, 32),
    )
    self.assertEqual(
        (scratch.learning_rate, scratch.lr_schedule), (1e-2, "constant")
    )
    self.assertEqual(scratch.warmup_steps, 0)
    tuned = RunOptions(init_from_hf=QWEN)
    self.assertEqual(tuned.recipe, recipes.FINE_TUNE)
    self.assertEqual(
        (
            tuned.learning_rate,
            tuned.lr_schedule,
            tuned.seq_len,
            tuned.batch_size,
        ),
        (2e-5, "cosine", 1024, 8),
    )
    self.assertEqual(tuned.warmup_steps, 30)  # 3 % of 1000
    lora = RunOptions(init_from_hf=QWEN, lora_rank=8)
    self.assertEqual((lora.recipe.name, lora.learning_rate), ("lora", 2e-4))

  def test_what_the_user_sets_wins(self):
    opts = RunOptions(
        init_from_hf=QWEN, steps=200, learning_rate=1e-4, lr_schedule="linear"
    )
    self.assertEqual(
        (opts.learning_rate, opts.lr_schedule, opts.warmup_steps),
        (1e-4, "linear", 6),  # the warmup follows the steps given
    )
    opts = RunOptions(init_from_hf=QWEN, steps=2, warmup_steps=1)
    self.assertEqual(opts.warmup_steps, 1)

  def test_init_from_a_directory_without_a_checkpoint(self):
    empty = helpers.tempdir(self)
    with self.assertRaisesRegex(
        ValueError, r"^init_from=.* is invalid: .* it holds no checkpoint"
    ):
      RunOptions(init_from=empty)
    with self.assertRaisesRegex(ValueError, "it does not exist"):
      RunOptions(init_from=os.path.join(empty, "nowhere"))
    err = cli_helpers.cli_error("train", "--init-from", empty)
    self.assertIn("holds no checkpoint", err)
    self.assertEqual(len(err.strip().splitlines()), 1)


class StepLinesTest(absltest.TestCase):
  """The lines written instead of a bar (no jax)."""

  def test_a_line_every_n_steps_and_no_nan_best(self):
    lines = []
    report = progress.StepReport(
        0,
        7,
        main=True,
        bar=True,
        every=3,
        best_loss=float("nan"),
        log=lines.append,
    )  # captured output is no terminal: lines, whatever `bar` says
    for i in report:
      report.step(i + 1, 2.5, 1e-3, 0, {"tokens_per_s": 1e3})
    steps = [int(re.match(r"step (\d+)/7: ", line)[1]) for line in lines]
    self.assertEqual(steps, [1, 3, 6, 7])
    self.assertNotIn("best", "".join(lines))
    self.assertNotIn("nan", "".join(lines))
    quiet = []
    other = progress.StepReport(
        0, 3, main=False, bar=False, every=1, best_loss=1.0, log=quiet.append
    )
    for i in other:
      other.step(i + 1, 2.5, 1e-3, 0, {"tokens_per_s": 1e3})
    self.assertEqual(quiet, [])  # only process 0 speaks


class RunAndInitFromTest(absltest.TestCase):
  """One tiny run in its default directory, then a new run from it."""

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
    self.assertEqual([r["step"] for r in rows], [1, 2, 3, 4, 5])
    self.assertEqual(rows[0]["recipe"]["name"], "scratch")
    self.assertNotIn("recipe", rows[1])
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

  def test_init_from_a_run(self):
    source = re.search(r"^run directory: (\S+) ", self.out, re.M)[1]
    run = os.path.join(helpers.tempdir(self), "tuned")
    # Another optimizer than the source's (constant 1e-2): a new run, not a
    # resume. A rate of 1e-30 leaves the weights as loaded.
    status, out, err = cli_helpers.cli(
        "train",
        "--init-from",
        source,
        "--checkpoint-dir",
        run,
        "--steps",
        "1",
        "--learning-rate",
        "1e-30",
        "--no-progress",
        *SHAPE,
    )
    self.assertEqual(status, 0, err)
    self.assertIn(f"linen-moe train: from {source}", out)
    self.assertIn("fine-tune recipe", out)
    _, loaded, _ = checkpoint.read_variables(source)
    _, tuned, step = checkpoint.read_variables(run)
    self.assertEqual(step, 1)  # a new run counts from 0
    loaded, tuned = map(helpers.flat_numpy, (loaded["params"], tuned["params"]))
    self.assertEqual(loaded.keys(), tuned.keys())
    for path, value in loaded.items():
      np.testing.assert_allclose(tuned[path], value, rtol=1e-6, err_msg=path)
    first = helpers.read_jsonl(os.path.join(run, "metrics.jsonl"))[0]
    self.assertEqual(first["recipe"]["name"], "fine-tune")
    self.assertEqual(first["recipe"]["learning_rate"], 1e-30)
    # Resuming the source with this rate is refused, and says what to do.
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


if __name__ == "__main__":
  absltest.main()
