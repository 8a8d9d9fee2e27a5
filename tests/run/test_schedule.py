"""A run's learning-rate schedule (`lr_schedule`, `warmup_steps`,
`final_lr_ratio`, `weight_decay`): the settings a run records and a resume
continues, and the learning rate of a step with skipped steps before it.
A resumed run continuing the schedule, every step's rate against the
formula: the resume tests; the schedules themselves:
tests/training/test_optimizer.py; the flags:
tests/cli/test_cli_train_schedule.py."""

from __future__ import annotations

from absl.testing import absltest
import numpy as np

from linen_moe._src.run import schedule
from linen_moe.training import RunOptions


class OptionsTest(absltest.TestCase):

  def test_unknown_schedule(self):
    with self.assertRaisesRegex(
        ValueError,
        r"^lr_schedule='step' is invalid: expected one of",
    ):
      RunOptions(lr_schedule="step")


class SettingsTest(absltest.TestCase):

  def test_settings_of_the_options(self):
    opts = RunOptions(steps=40, lr_schedule="cosine", warmup_steps=5)
    self.assertEqual(
        schedule.settings(opts),
        {
            "learning_rate": 1e-2,
            "lr_schedule": "cosine",
            "warmup_steps": 5,
            "total_steps": 40,
            "final_lr_ratio": 0.1,
            "weight_decay": 0.0,
        },
    )
    constant = schedule.settings(RunOptions(weight_decay=0.1))
    self.assertIsNone(constant["total_steps"])
    self.assertIsNone(constant["final_lr_ratio"])
    self.assertEqual(constant["weight_decay"], 0.1)

  def test_a_resume_keeps_the_schedule(self):
    began = schedule.settings(RunOptions(steps=12, lr_schedule="linear"))
    notes = []
    longer = schedule.settings(RunOptions(steps=20, lr_schedule="linear"))
    kept = schedule.resumed(
        longer, {"optimizer": began}, "ckpt/12", notes.append
    )
    self.assertEqual(kept, began)  # the length the run began with
    self.assertRegex(notes[0], "keeps the length the run began with, 12")
    # A checkpoint from before the schedules: the options' settings.
    self.assertEqual(schedule.resumed(longer, {"seed": 0}, "ckpt/12"), longer)
    other = schedule.settings(
        RunOptions(steps=12, lr_schedule="linear", learning_rate=3e-3)
    )
    with self.assertRaisesRegex(
        ValueError,
        r"ckpt/12 has another optimizer: `learning_rate` 0.003 here, 0.01 "
        r"there\. A resume continues a run exactly: resume with its settings "
        r"\(`learning_rate` 0.01 `lr_schedule` linear `warmup_steps` 0 "
        r"`final_lr_ratio` 0.1 `weight_decay` 0.0\), or start a new run from "
        r"its weights with these settings: `init_from` ckpt and a new "
        r"`checkpoint_dir`\.",
    ):
      schedule.resumed(other, {"optimizer": began}, "ckpt/12")

  def test_skipped_steps_hold_the_schedule(self):
    # Steps 0..4, step 2 skipped: the updates before each are 0, 1, 2, 2, 3.
    settings = schedule.settings(
        RunOptions(steps=10, lr_schedule="linear", final_lr_ratio=0.0)
    )
    _, lr_schedule = schedule.optimizer(settings)
    skipped = [0, 0, 1, 0, 0]
    rates = [
        schedule.learning_rate(
            lr_schedule,
            i,
            {"skipped": s, "skipped_steps": sum(skipped[: i + 1])},
        )
        for i, s in enumerate(skipped)
    ]
    np.testing.assert_allclose(
        rates, [1e-2 * (1 - n / 10) for n in (0, 1, 2, 2, 3)], rtol=1e-6
    )


if __name__ == "__main__":
  absltest.main()
