"""The lines a run writes instead of a progress bar
(`RunOptions(progress=False)`, or output that is no terminal): one every
`log_every` steps, the first and the last, only on process 0, no best loss
where it is unknown; a run that stops between two lines (a callback, a
signal) still ends on its last step's line. The lines in a whole run of the
command: tests/cli/test_cli_fine_tune.py."""

from __future__ import annotations

import re

from absl.testing import absltest

from linen_moe import load_model_config
from linen_moe import training
from linen_moe._src.run import progress
from linen_moe._src.testing import helpers


def _steps(lines: list[str], total: int) -> list[int]:
  return [
      int(m[1])
      for line in lines
      if (m := re.match(rf"step (\d+)/{total}: ", line))
  ]


def _report(steps: int, every: int, lines: list[str]) -> progress.StepReport:
  # Captured output is no terminal: lines, whatever `bar` says.
  return progress.StepReport(
      0,
      steps,
      main=True,
      bar=True,
      every=every,
      best_loss=float("nan"),
      log=lines.append,
  )


class StepLinesTest(absltest.TestCase):
  """The lines written instead of a bar (no jax)."""

  def test_a_line_every_n_steps_and_no_nan_best(self):
    lines = []
    report = _report(7, 3, lines)
    for i in report:
      report.step(i + 1, 2.5, 1e-3, 0, {"tokens_per_s": 1e3})
    report.close()  # the last line was due: nothing written twice
    self.assertEqual(_steps(lines, 7), [1, 3, 6, 7])
    self.assertNotIn("best", "".join(lines))
    self.assertNotIn("nan", "".join(lines))
    quiet = []
    other = progress.StepReport(
        0, 3, main=False, bar=False, every=1, best_loss=1.0, log=quiet.append
    )
    for i in other:
      other.step(i + 1, 2.5, 1e-3, 0, {"tokens_per_s": 1e3})
    self.assertEqual(quiet, [])  # only process 0 speaks

  def test_a_run_stopped_between_lines_ends_on_its_step(self):
    lines = []
    report = _report(7, 3, lines)
    for done in (1, 2, 3, 4, 5):
      report.step(done, 2.0 + done, None, 0, {"tokens_per_s": 1e3})
    report.close()
    self.assertEqual(_steps(lines, 7), [1, 3, 5])
    self.assertIn("step 5/7: loss 7.0000,", lines[-1])
    report.close()  # a second close writes nothing more
    self.assertLen(lines, 3)


class Stop(training.Callback):

  def after_step(self, run, step):
    if step.step == 4:
      run.stop("enough")


class StoppedRunTest(absltest.TestCase):

  def test_the_stopped_step_has_its_line(self):
    lines = []
    result = training.run(
        training.RunOptions(
            config=load_model_config("tiny_mixtral").replace(num_layers=1),
            steps=9,
            batch_size=2,
            seq_len=8,
            progress=False,
            log_every=3,
            checkpoint_dir=helpers.tempdir(self),
        ),
        callbacks=[Stop()],
        log=lines.append,
    )
    self.assertEqual(result.stop_reason, "enough")
    self.assertEqual(_steps(lines, 9), [1, 3, 4])
    self.assertIn(f"step 4/9: loss {result.losses[-1]:.4f}", "\n".join(lines))


if __name__ == "__main__":
  absltest.main()
