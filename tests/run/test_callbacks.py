"""`training.run(..., callbacks=...)`: a user's observers beside (or in
place of) the run's own; a callback that stops the run or raises ends it
saved, as a SIGTERM does (issue 64, item 2)."""

import os
import shutil
import tempfile

from absl.testing import absltest

from linen_moe import load_model_config
from linen_moe import training
from linen_moe._src.testing import helpers

TINY = load_model_config("tiny_mixtral").replace(num_layers=1)
SHAPE = dict(steps=4, batch_size=2, seq_len=8, progress=False, log_every=1)


def _options(directory: str, **fields) -> training.RunOptions:
  return training.RunOptions(
      config=TINY, checkpoint_dir=directory, **(SHAPE | fields)
  )


class Recorder(training.Callback):
  """What it was told, and a metric of its own on every step."""

  def __init__(self, stop_at=None, fail_at=None):
    self.calls, self.stop_at, self.fail_at = [], stop_at, fail_at

  def on_start(self, run):
    self.calls.append(("start", run.start_step, run.steps))

  def after_step(self, run, step):
    self.calls.append(("step", step.step))
    step.metrics["twice_the_loss"] = 2 * step.loss
    if step.step == self.fail_at:
      raise ZeroDivisionError("the evaluation divided by zero")
    if step.step == self.stop_at:
      run.stop("good enough")

  def on_end(self, run, error):
    self.calls.append(("end", type(error).__name__ if error else None))


class QuietProgress(training.Callback):
  name = "progress"  # takes the place of the run's own

  def __init__(self):
    self.steps = []

  def after_step(self, run, step):
    self.steps.append(step.step)


class CallbacksTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.whole_dir = tempfile_dir = tempfile.mkdtemp()
    cls.addClassCleanup(shutil.rmtree, tempfile_dir, ignore_errors=True)
    cls.recorder, cls.progress, cls.lines = Recorder(), QuietProgress(), []
    cls.whole = training.run(
        _options(tempfile_dir),
        log=cls.lines.append,
        callbacks=[cls.recorder, cls.progress],
    )

  def test_a_callback_sees_every_step_and_adds_metrics(self):
    self.assertEqual(
        self.recorder.calls,
        [("start", 0, 4), *(("step", s) for s in (1, 2, 3, 4)), ("end", None)],
    )
    rows = helpers.run_metrics(self.whole_dir)
    self.assertEqual(
        [r["twice_the_loss"] for r in rows],
        [2 * r["cross_entropy"] for r in rows],
    )

  def test_a_callback_named_as_a_default_replaces_it(self):
    self.assertEqual(self.progress.steps, [1, 2, 3, 4])
    self.assertFalse([x for x in self.lines if x.startswith("step ")])

  def test_stop_saves_the_step_and_a_resume_continues_the_same_run(self):
    where = helpers.tempdir(self)
    stopper = Recorder(stop_at=2)
    result = training.run(
        _options(where), log=lambda _: None, callbacks=[stopper]
    )
    self.assertEqual(result.stop_reason, "good enough")
    self.assertLen(result.losses, 2)
    self.assertIn("2", os.listdir(where))  # saved, though not due
    self.assertEqual(stopper.calls[-1], ("end", None))
    resumed = training.run(
        _options(where), log=lambda _: None, callbacks=[Recorder()]
    )
    self.assertEqual(resumed.start_step, 2)
    self.assertEqual(
        helpers.run_metrics(where), helpers.run_metrics(self.whole_dir)
    )

  def test_an_exception_stops_the_run_saved(self):
    where = helpers.tempdir(self)
    failing = Recorder(fail_at=3)
    with self.assertRaisesRegex(
        training.RunStopped,
        r"^callback Recorder failed after step 3 \(ZeroDivisionError: the "
        r"evaluation divided by zero\); the run stopped, step 3 saved in ",
    ) as caught:
      training.run(_options(where), log=lambda _: None, callbacks=[failing])
    self.assertIsInstance(caught.exception.__cause__, ZeroDivisionError)
    self.assertIn("3", os.listdir(where))
    self.assertEqual(
        helpers.run_metrics(where), helpers.run_metrics(self.whole_dir)[:3]
    )
    self.assertEqual(failing.calls[-1], ("end", "RunStopped"))

  def test_a_callback_must_be_one(self):
    with self.assertRaisesRegex(TypeError, "callbacks: .* is not a"):
      training.run(_options(None), callbacks=[print])


if __name__ == "__main__":
  absltest.main()
