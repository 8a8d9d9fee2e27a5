"""`linen-moe train --data`: the user's text through the command line.

A run stopped at step 6 and resumed to 12 equals the uninterrupted run in
every metric of every step (held-out losses included) and in every leaf of
the final checkpoint, on padded batches (the mask in the loss) with
gradient accumulation: in Linen (default run); in NNX, across the two front
ends, and from 1 process to 2 with the same global batch (slow). Bad input
is one line naming the file, before any step. The loss chart draws both
curves.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from flax import traverse_util
import matplotlib.figure
import numpy as np

from linen_moe import checkpoint
from linen_moe import data
from linen_moe import testing
from linen_moe._src.parallel import launcher as launch
from linen_moe._src.run import loss_chart
from linen_moe._src.run import sources as train_data
from linen_moe._src.testing import helpers
from linen_moe.training import RunOptions
from tests import cli_helpers

STOP, STEPS = 6, 12
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
MIXTRAL = os.path.join(ROOT, "tests", "fixtures", "hf", "mixtral_gqa_swa")


_run_cli = cli_helpers.cli


def _final_tree(directory: str) -> dict:
  with checkpoint.Checkpoints(directory) as ckpts:
    leaves = ckpts.saved_leaves()
    tree = ckpts.read(ckpts.latest_step(), checkpoint.abstract(leaves))
  return {p: np.asarray(x) for p, x in traverse_util.flatten_dict(tree).items()}


class _Corpus(helpers.TempDirMixin, absltest.TestCase):
  """A directory of license texts and a tokenizer trained on them (256
  tokens: the tiny configs' vocabulary), shared by the class."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.corpus = os.path.join(cls.tmp, "corpus")
    os.makedirs(cls.corpus)
    for i, path in enumerate(testing.license_texts()):
      shutil.copy(path, os.path.join(cls.corpus, f"{i:02d}.txt"))
    cls.tokenizer = os.path.join(cls.tmp, "tokenizer.json")
    data.train_bpe_tokenizer(testing.license_texts(), 256, cls.tokenizer)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  def argv(self, *extra: str) -> list[str]:
    return [
        "train",
        "--set",
        "num_layers=1",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--grad-accum",
        "2",
        "--learning-rate",
        "3e-3",
        "--data",
        self.corpus,
        "--tokenizer",
        self.tokenizer,
        "--packing",
        "pad",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--save-every",
        "6",
        "--no-progress",
        *extra,
    ]

  def train(self, directory: str, steps: int, *extra: str) -> str:
    argv = self.argv("--steps", str(steps), "--checkpoint-dir", directory)
    code, out, err = _run_cli(*argv, *extra)
    self.assertEqual(code, 0, err)
    return out

  def check_same_run(self, whole: str, split: str, trees: bool = True):
    """The run in `whole` (started for STEPS steps) against `split`'s
    (started for STOP, resumed to STEPS): every metric of every step."""
    resumed = cli_helpers.as_started_for(
        self, helpers.run_metrics(split), STOP, STEPS
    )
    self.assertEqual(resumed, helpers.run_metrics(whole))
    if trees:
      a, b = _final_tree(whole), _final_tree(split)
      self.assertEqual(sorted(a), sorted(b))
      for p in a:
        np.testing.assert_array_equal(b[p], a[p], err_msg=str(p))


# Slow: 4 runs. The default run resumes the command in test_cli_resume.py
# and a data iterator in test_data.py (IteratorCheckpointTest).
@testing.slow
class ResumeTest(_Corpus):

  def test_resume_is_exact(self):
    tmp = self.tempdir()
    dirs = {k: os.path.join(tmp, k) for k in ("whole", "split")}
    out = self.train(dirs["whole"], STEPS)
    self.assertIn("step 12: held-out loss", out)
    self.assertRegex(out, r"held-out loss: \d+\.\d+ \(perplexity \d+")
    self.assertNotIn("best achievable", out)
    self.train(dirs["split"], STOP)
    out = self.train(dirs["split"], STEPS)
    self.assertIn("resumed from step 6", out)
    self.check_same_run(dirs["whole"], dirs["split"])

    rows = helpers.run_metrics(dirs["whole"])
    self.assertEqual([r["step"] for r in rows], list(range(1, STEPS + 1)))
    self.assertTrue(all(np.isfinite(r["loss"]) for r in rows))
    evaluated = [r["step"] for r in rows if "eval_loss" in r]
    self.assertEqual(evaluated, [4, 8, 12])
    for r in rows:
      if "eval_loss" in r:
        self.assertAlmostEqual(r["eval_perplexity"], np.exp(r["eval_loss"]))
    self.assertTrue(os.path.isfile(os.path.join(dirs["whole"], "losses.png")))
    with checkpoint.Checkpoints(dirs["split"]) as ckpts:
      self.assertTrue(ckpts.has_data())
      meta = ckpts.meta()["data"]
    self.assertEqual(meta["kind"], "corpus")
    self.assertEqual(meta["pipeline"]["packing"], "pad")
    state = os.path.join(dirs["split"], "12", "data", "process_0-of-1.json")
    with open(state, encoding="utf-8") as f:
      self.assertEqual(json.load(f), {"next_index": STEPS})

    # Resuming on other data, or on none, is refused before any step.
    argv = self.argv("--steps", "15", "--checkpoint-dir", dirs["split"])
    for bad, message in (
        (["--seq-len", "8"], r"read other data: .*seq_len=16 there, 8 here"),
        (["--packing", "pack"], "packing='pad' there, 'pack' here"),
    ):
      code, _, err = _run_cli(*argv, *bad)
      self.assertEqual(code, 2, err)
      self.assertRegex(err, message)
    code, _, err = _run_cli(
        "train", "--set", "num_layers=1", "--batch-size", "4", "--seq-len",
        "16", "--steps", "15", "--checkpoint-dir", dirs["split"],
        "--learning-rate", "3e-3",  # the run's optimizer: only the data differs
    )  # fmt: skip
    self.assertEqual(code, 2)
    self.assertRegex(err, r"was trained on .*00.txt \(and \d+ more files\)")
    self.assertLen(helpers.run_metrics(dirs["split"]), STEPS)


@testing.slow
class FirstFitTest(_Corpus):

  def test_first_fit_rows_train_with_segments(self):
    # Two steps of two microbatches and one held-out loss, on rows packed
    # first fit: the fill is reported, the losses are finite.
    out = self.train(
        self.tempdir(), 2, "--eval-every", "2", "--packing", "first_fit"
    )
    self.assertRegex(out, r"packing first_fit: \d+\.\d% of positions hold")
    self.assertRegex(out, r"step 2: held-out loss \d+\.\d+")


class BadInputTest(_Corpus):
  """Each bad input is one line naming the file and the problem, exit
  status 2, before any step (no metrics row, no checkpoint)."""

  def test_bad_input_before_any_step(self):
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
        (["--data", os.path.join(tmp, "none.txt")], "none.txt: no such file"),
        (["--data", empty], "a.txt: the corpus is empty"),
        (["--data", short], r"short.txt: the corpus has \d tokens, fewer than"),
        (["--tokenizer", big], "big.json: its vocabulary of 300 tokens is"),
        (["--tokenizer", corrupt], "corrupt.json: cannot be read as a tok"),
        (["--data", ids], r"ids.npy: id 256 at position 2 is outside \[0, "),
    ]
    for extra, message in cases:
      with self.subTest(message=message):
        directory = os.path.join(tmp, "run")
        code, out, err = _run_cli(
            *self.argv("--steps", "2", "--checkpoint-dir", directory), *extra
        )
        self.assertEqual(code, 2, out + err)
        self.assertRegex(err, f"^linen-moe: error: .*{message}")
        self.assertEqual(err.count("\n"), 1, err)
        self.assertFalse(os.path.exists(os.path.join(directory, "1")))
        self.assertFalse(
            os.path.exists(os.path.join(directory, "metrics.jsonl"))
        )

  def test_flags_checked_before_jax(self):
    for extra, message in (
        (["--eval-every", "2"], r"eval_every=2 \(--eval-every\) .* needs --data"),
        (["--tokenizer", "t.json"], r"tokenizer='t.json' .* needs --data"),
        (["--data", ".", "--eval-every", "2", "--eval-fraction", "0"], "holds none"),
        (["--data", ".", "--data-dtype", "uint16", "--data-format", "npy"], "only 'bin'"),
    ):  # fmt: skip
      code, _, err = _run_cli("train", *extra)
      self.assertEqual(code, 2)
      self.assertRegex(err, message)


class LossChartTest(absltest.TestCase):
  """losses.png: the training cross-entropy of every step and the held-out
  loss of the evaluated steps, from metrics.jsonl."""

  def test_both_curves(self):
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    metrics = os.path.join(directory, "metrics.jsonl")
    rows = [{"step": i, "loss": 9.0, "cross_entropy": 5.0 - i} for i in (1, 2)]
    rows[1].update(eval_loss=4.5, eval_perplexity=90.0)
    with open(metrics, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
      f.write('{"step": 3, "cross_')  # a torn last line is passed over
    figures = []
    save = matplotlib.figure.Figure.savefig

    def recording_save(fig, *args, **kwargs):
      figures.append(fig)
      return save(fig, *args, **kwargs)

    logged = []
    with mock.patch.object(matplotlib.figure.Figure, "savefig", recording_save):
      out = loss_chart.chart_beside(metrics, logged.append)
    self.assertEqual(out, os.path.join(directory, "losses.png"))
    self.assertEqual(logged, [f"chart of the losses: {out}"])
    (fig,) = figures
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    self.assertEqual(set(lines), {"train (cross-entropy)", "held-out"})
    train, held_out = lines["train (cross-entropy)"], lines["held-out"]
    np.testing.assert_array_equal(train.get_xdata(), [1, 2])
    np.testing.assert_array_equal(train.get_ydata(), [4.0, 3.0])
    np.testing.assert_array_equal(held_out.get_xdata(), [2])
    np.testing.assert_array_equal(held_out.get_ydata(), [4.5])
    with open(out, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    os.remove(out)
    logged.clear()
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
      self.assertIsNone(loss_chart.chart_beside(metrics, logged.append))
    self.assertFalse(os.path.exists(out))
    (line,) = logged
    self.assertRegex(line, r"^matplotlib is not installed, .*losses.png")


class _HfCheckpoint(_Corpus):
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
  """`--init-from-hf DIR` tokenizes with DIR/tokenizer.json unless
  `--tokenizer` names another."""

  def test_the_checkpoints_tokenizer(self):
    directory = self.hf_dir()
    opts = RunOptions(init_from_hf=directory, data=self.corpus)
    self.assertEqual(
        train_data.tokenizer_path(opts),
        os.path.join(directory, "tokenizer.json"),
    )
    opts = RunOptions(
        init_from_hf=directory, data=self.corpus, tokenizer=self.tokenizer
    )
    self.assertEqual(train_data.tokenizer_path(opts), self.tokenizer)
    bare = RunOptions(init_from_hf=self.hf_dir(False), data=self.corpus)
    self.assertIsNone(train_data.tokenizer_path(bare))
    # The run's own 256-token tokenizer does not fit the fixture's 64.
    code, _, err = _run_cli(
        "train", "--init-from-hf", directory, "--data", self.corpus,
        "--tokenizer", self.tokenizer, "--steps", "1",
    )  # fmt: skip
    self.assertEqual(code, 2)
    self.assertIn("larger than the model's vocab_size=64", err)
    code, _, err = _run_cli(
        "train", "--init-from-hf", self.hf_dir(False), "--data", self.corpus,
        "--steps", "1",
    )  # fmt: skip
    self.assertEqual(code, 2)
    self.assertIn("text needs a tokenizer", err)


@testing.slow
class FineTuneHfTest(_HfCheckpoint):

  def test_held_out_loss_falls(self):
    """The Mixtral fixture fine-tuned on the corpus with its own tokenizer:
    the held-out loss falls."""
    directory = self.hf_dir()
    run = os.path.join(self.tempdir(), "run")
    code, out, err = _run_cli(
        "train", "--init-from-hf", directory, "--data", self.corpus,
        "--steps", "40", "--batch-size", "8", "--seq-len", "32",
        "--learning-rate", "3e-3", "--eval-every", "5", "--eval-batches", "2",
        "--checkpoint-dir", run, "--no-progress",
    )  # fmt: skip
    self.assertEqual(code, 0, err)
    held_out = [
        r["eval_loss"] for r in helpers.run_metrics(run) if "eval_loss" in r
    ]
    self.assertLen(held_out, 8)
    self.assertLess(held_out[-1], held_out[0] - 0.5, held_out)
    with checkpoint.Checkpoints(run) as ckpts:
      corpus = ckpts.meta()["data"]["pipeline"]["corpus"]
    self.assertEqual(
        corpus["tokenizer"], os.path.join(directory, "tokenizer.json")
    )


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
class SlowResumeTest(_Corpus):

  def test_resume_in_nnx_and_across_front_ends(self):
    """NNX 12 steps against NNX 6 then 12; a copy of the NNX run at 6
    resumed in Linen and a Linen run at 6 resumed in NNX match too."""
    tmp = self.tempdir()
    dirs = {
        k: os.path.join(tmp, k)
        for k in ("whole", "split", "to_linen", "linen", "to_nnx")
    }
    nnx = ("--frontend", "nnx")
    self.train(dirs["whole"], STEPS, *nnx)
    self.train(dirs["split"], STOP, *nnx)
    shutil.copytree(dirs["split"], dirs["to_linen"])
    self.train(dirs["split"], STEPS, *nnx)
    self.check_same_run(dirs["whole"], dirs["split"])
    self.train(dirs["to_linen"], STEPS)
    self.check_same_run(dirs["whole"], dirs["to_linen"], trees=False)
    self.train(dirs["to_nnx"], STOP)
    self.train(dirs["to_nnx"], STEPS, *nnx)
    self.check_same_run(dirs["whole"], dirs["to_nnx"], trees=False)

  def test_resume_from_one_process_to_two(self):
    """Steps 1-6 on 1 process x 2 devices, 7-12 on 2 processes x 1 device
    (each reading half of each batch of 4), against 1-12 on 1 x 2."""
    tmp = self.tempdir()
    whole, split = os.path.join(tmp, "whole"), os.path.join(tmp, "split")
    argv = [a for a in self.argv("--mesh", "data=2") if a != "--no-progress"]
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
