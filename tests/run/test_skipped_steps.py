"""Steps a run cannot train on: a batch holding an id outside the
vocabulary is rejected before its step (before the model is built), and a
step with a non-finite loss or gradient is skipped, the run stopping after
`max_consecutive_skips` of them in a row. The skip itself (the state kept as
it was): tests/training/test_skip_steps.py; the command's line for a run that
stopped: tests/cli/test_cli_train.py."""

from unittest import mock

from absl.testing import absltest
import numpy as np

from linen_moe import training
from linen_moe.training import MarkovData
from linen_moe.training import RunOptions

V = 256  # tiny_mixtral's vocabulary


class BadBatchTest(absltest.TestCase):

  def test_bad_batch_is_rejected_before_its_step(self):
    def batches(self, batch_size, seq_len, seed=1, start=0):
      del self, seed, start
      yield np.full((batch_size, seq_len), V, np.int32)

    with (
        mock.patch.object(MarkovData, "batches", batches),
        mock.patch.object(training.LinenFrontend, "init") as init,
    ):
      with self.assertRaisesRegex(
          ValueError, rf"batch\[0, 0\]={V} is invalid: .*vocab_size={V}"
      ):
        training.run(RunOptions(steps=1, batch_size=2, seq_len=4))
    init.assert_not_called()  # no model was built


class _Steps(training.Callback):
  """Records (step, skipped) after each step."""

  def __init__(self):
    self.skipped = []

  def after_step(self, run, step):
    del run
    self.skipped.append((step.step, int(step.metrics["skipped"])))


class SkippedStepsTest(absltest.TestCase):

  def test_stops_after_consecutive_skips(self):
    # The first step (learning rate 1e30) applies and sends every parameter
    # to ~1e30; every later step overflows and is skipped.
    seen = _Steps()
    opts = RunOptions(
        steps=6,
        batch_size=2,
        seq_len=8,
        learning_rate=1e30,
        max_consecutive_skips=3,
        progress=False,
    )
    with self.assertRaises(training.RunStopped) as caught:
      training.run(opts, log=lambda _: None, callbacks=[seen])
    self.assertEqual(
        str(caught.exception),
        "stopped at step 4 of 6: the last 3 steps (2 to 4) were all skipped "
        "for a non-finite loss or gradient (`max_consecutive_skips` 3; 3 "
        "skipped in all). The run is not recovering: lower `learning_rate`, "
        "or check the data.",
    )
    self.assertIsNone(caught.exception.signal)  # stopped on purpose
    self.assertEqual(caught.exception.exit_code, 1)
    # Steps 1 to 4 ran, the last three skipped; none after.
    self.assertEqual(seen.skipped, [(1, 0), (2, 1), (3, 1), (4, 1)])


if __name__ == "__main__":
  absltest.main()
