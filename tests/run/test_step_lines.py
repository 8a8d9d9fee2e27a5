"""The lines a run writes instead of a progress bar
(`RunOptions(progress=False)`, or output that is no terminal): one every
`log_every` steps, the first and the last, only on process 0, no best loss
where it is unknown. The lines in a whole run of the command:
tests/cli/test_cli_fine_tune.py."""

from __future__ import annotations

import re

from absl.testing import absltest

from linen_moe._src.run import progress


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


if __name__ == "__main__":
  absltest.main()
