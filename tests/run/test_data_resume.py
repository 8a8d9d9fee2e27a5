"""A run on the user's files (`RunOptions(data=...)`) stopped and resumed.

A run stopped at step 6 and resumed to 12 equals the uninterrupted run in
every metric of every step (held-out losses included) and in every leaf of
the final checkpoint, on padded batches (the mask in the loss) with
gradient accumulation: in Linen, in NNX and across the two front ends
(slow). A resume on other data, or on none, is refused before any step.
From one process to two: tests/cli/test_cli_train_data.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe import testing
from linen_moe import training
from linen_moe._src.testing import helpers
import nnx_adapter
from tests import corpus_fixture

STOP, STEPS = corpus_fixture.STOP, corpus_fixture.STEPS


def _final_tree(directory: str) -> dict:
  with checkpoint.Checkpoints(directory) as ckpts:
    leaves = ckpts.saved_leaves()
    tree = ckpts.read(ckpts.latest_step(), checkpoint.abstract(leaves))
  return helpers.flat_numpy(tree)


class _Resume(corpus_fixture.CorpusTestCase):

  def check_same_run(self, whole: str, split: str, trees: bool = True):
    """The run in `whole` (started for STEPS steps) against `split`'s
    (started for STOP, resumed to STEPS): every metric of every step."""
    resumed = helpers.run_metrics(split)
    # The first row records the steps the run was started for.
    self.assertEqual(resumed[0]["recipe"]["steps"], STOP)
    resumed[0]["recipe"]["steps"] = STEPS
    self.assertEqual(resumed, helpers.run_metrics(whole))
    if trees:
      a, b = _final_tree(whole), _final_tree(split)
      self.assertEqual(sorted(a), sorted(b))
      for p in a:
        np.testing.assert_array_equal(b[p], a[p], err_msg=str(p))


# Slow: 4 runs. The default run resumes a run on synthetic data (the
# resume tests) and a data iterator (tests/data/test_data.py,
# IteratorCheckpointTest).
@testing.slow
class ResumeTest(_Resume):

  def test_resume_is_exact(self):
    tmp = self.tempdir()
    dirs = {k: os.path.join(tmp, k) for k in ("whole", "split")}
    result, logged = self.train(dirs["whole"], STEPS)
    self.assertTrue(any(x.startswith("step 12: held-out loss") for x in logged))
    self.assertTrue(math.isnan(result.best_loss))  # unknown for real data
    self.train(dirs["split"], STOP)
    resumed, logged = self.train(dirs["split"], STEPS)
    self.assertTrue(any(x.startswith("resumed from step 6") for x in logged))
    self.assertEqual(resumed.start_step, STOP)
    self.check_same_run(dirs["whole"], dirs["split"])

    rows = helpers.run_metrics(dirs["whole"])
    self.assertEqual([r["step"] for r in rows], list(range(1, STEPS + 1)))
    self.assertTrue(all(np.isfinite(r["loss"]) for r in rows))
    held_out = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    self.assertEqual([step for step, _ in held_out], [4, 8, 12])
    self.assertEqual(result.eval_losses, held_out)
    self.assertEqual(resumed.eval_losses, held_out[1:])  # steps 8 and 12
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
    for changes, message in (
        ({"seq_len": 8}, r"read other data: .*seq_len=16 there, 8 here"),
        ({"packing": "pack"}, "packing='pad' there, 'pack' here"),
    ):
      with self.assertRaisesRegex(ValueError, message):
        self.train(dirs["split"], 15, **changes)
    no_data = training.RunOptions(
        overrides={"num_layers": 1},
        batch_size=4,
        seq_len=16,
        steps=15,
        checkpoint_dir=dirs["split"],
        learning_rate=3e-3,  # the run's optimizer: only the data differs
    )
    with self.assertRaisesRegex(
        ValueError, r"was trained on .*00.txt \(and \d+ more files\)"
    ):
      training.run(no_data, log=lambda _: None)
    self.assertLen(helpers.run_metrics(dirs["split"]), STEPS)


@testing.slow
class FrontEndsResumeTest(_Resume):

  def test_resume_in_nnx_and_across_front_ends(self):
    """NNX 12 steps against NNX 6 then 12; a copy of the NNX run at 6
    resumed in Linen and a Linen run at 6 resumed in NNX match too."""
    tmp = self.tempdir()
    dirs = {
        k: os.path.join(tmp, k)
        for k in ("whole", "split", "to_linen", "to_nnx")
    }
    nnx = nnx_adapter.NNXFrontend
    self.train(dirs["whole"], STEPS, nnx)
    self.train(dirs["split"], STOP, nnx)
    shutil.copytree(dirs["split"], dirs["to_linen"])
    self.train(dirs["split"], STEPS, nnx)
    self.check_same_run(dirs["whole"], dirs["split"])
    self.train(dirs["to_linen"], STEPS)
    self.check_same_run(dirs["whole"], dirs["to_linen"], trees=False)
    self.train(dirs["to_nnx"], STOP)
    self.train(dirs["to_nnx"], STEPS, nnx)
    self.check_same_run(dirs["whole"], dirs["to_nnx"], trees=False)


if __name__ == "__main__":
  absltest.main()
