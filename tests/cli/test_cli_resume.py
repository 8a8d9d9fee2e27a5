"""`linen-moe train --checkpoint-dir`: a run directory resumed by the same
command, or by it in the other front end (`--frontend nnx`), equals an
uninterrupted run (every metric of every step, the final checkpoint), with
the command's lines (the resume, the banner's steps, "already at step") and
its refusals of another run's flags (exit status 2, the flags named).

The run's resume in every mode, across a schedule, with fresh fp8 state and
after SIGKILLs: tests/run/test_resume.py; the library's exact resume of a
train state: tests/checkpoint/test_resume.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from tests import cli_helpers

STOP, STEPS = 6, 12


_run_cli = cli_helpers.cli


TRAIN = (
    "train",
    "--config",
    "tiny_mixtral",
    "--quantization",
    "fp8",
    "--batch-size",
    "2",
    "--seq-len",
    "8",
    "--save-every",
    "3",
    "--no-progress",
)


class TrainCommandResumeTest(absltest.TestCase):
  """`linen-moe train`: `whole` runs 12 steps in one command (Linen),
  `split` 6 and then the same command with 12, `in_nnx` resumes a copy of
  `split` at step 6 to 12 with `--frontend nnx` (the library's crossing:
  test_nnx_fp8.py, test_checkpoint.py). One test, so that the runs are not
  repeated per test process."""

  @heavy
  def test_resume_from_the_command_line(self):
    self.check_resume(in_nnx=True)

  def check_resume(self, in_nnx: bool):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    dirs = {k: os.path.join(tmp, k) for k in ("whole", "split", "in_nnx")}
    outputs = {}

    def run(name, steps, *extra):
      code, out, _ = _run_cli(
          *TRAIN, "--steps", str(steps), "--checkpoint-dir", dirs[name], *extra
      )
      self.assertEqual(code, 0, out)
      outputs.setdefault(name, []).append(out)

    run("whole", STEPS)
    run("split", STOP)
    if in_nnx:
      shutil.copytree(dirs["split"], dirs["in_nnx"])
    run("split", STEPS)
    if in_nnx:
      run("in_nnx", STEPS, "--frontend", "nnx")

    whole, split = helpers.run_metrics(dirs["whole"]), helpers.run_metrics(
        dirs["split"]
    )
    self.assertEqual(whole[0]["recipe"]["steps"], STEPS)
    split = cli_helpers.as_started_for(self, split, STOP, STEPS)
    self.assertEqual([m["step"] for m in split], list(range(1, STEPS + 1)))
    self.assertEqual(split, whole)  # every metric of every step, exactly
    self.assertNotIn("resumed", outputs["split"][0])
    self.assertIn("resumed from step 6", outputs["split"][1])
    # The banner counts the steps this run takes, not those behind it.
    self.assertIn(f"  steps {STOP + 1}-{STEPS}, ", outputs["split"][1])
    self.assertIn(f"  steps 1-{STOP}, ", outputs["split"][0])
    if in_nnx:  # a Linen run resumed in NNX matches too
      resumed = helpers.run_metrics(dirs["in_nnx"])
      self.assertIn("resumed from step 6", outputs["in_nnx"][0])
      self.assertEqual([m["step"] for m in resumed], list(range(1, STEPS + 1)))
      # One update rule in both front ends, fp8 state included: every
      # resumed step's loss that of the Linen run (batch 8 x 32: 8.6e-5
      # relative apart at step 12 when the NNX step rounded its update
      # otherwise; test_nnx_fp8.py).
      np.testing.assert_allclose(
          [m["loss"] for m in resumed[STOP:]],
          [m["loss"] for m in whole[STOP:]],
          rtol=1e-6,
      )
      final, linen = _final_tree(dirs["in_nnx"]), _final_tree(dirs["whole"])
      self.assertEqual(sorted(final), sorted(linen))
      for p in linen:  # the state too: fp8 scale histories, weights, moments
        np.testing.assert_allclose(
            np.asarray(final[p], np.float64),
            np.asarray(linen[p], np.float64),
            rtol=1e-6,
            err_msg=str(p),
        )
    with checkpoint.Checkpoints(dirs["split"]) as ckpts:
      self.assertEqual(ckpts.all_steps(), [6, 9, 12])  # --keep 3
      self.assertEqual(ckpts.meta()["data"]["position"], STEPS)

    code, out, _ = _run_cli(
        *TRAIN, "--steps", "12", "--checkpoint-dir", dirs["split"]
    )
    self.assertEqual(code, 0)
    self.assertIn("already at step 12 (--steps 12)", out)
    again = cli_helpers.as_started_for(
        self, helpers.run_metrics(dirs["split"]), STOP, STEPS
    )
    self.assertEqual(again, whole)

    argv = [*TRAIN, "--steps", "13", "--checkpoint-dir", dirs["split"]]
    gemma = [a if a != "tiny_mixtral" else "tiny_gemma4_26b" for a in argv]
    for bad, message in (
        (gemma, "another model config: .*num_experts=8 there, 16 here"),
        ([*argv, "--seed", "3"], "--seed 3 differs from the seed 0"),
    ):
      code, _, err = _run_cli(*bad)
      self.assertEqual(code, 2)
      self.assertRegex(err, message)


def _final_tree(directory: str) -> dict:
  with checkpoint.Checkpoints(directory) as ckpts:
    leaves = ckpts.saved_leaves()
    return helpers.flat_numpy(
        ckpts.read(ckpts.latest_step(), checkpoint.abstract(leaves))
    )


if __name__ == "__main__":
  absltest.main()
