"""`linen-moe train --lr-schedule/--warmup-steps/--final-lr-ratio/
--weight-decay`: the flags, checked before jax, each error one line naming
the flag. What a run does with them (the settings it records and a resume
continues, a skipped step's rate): tests/run/test_schedule.py."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import testing
from linen_moe_cli import main as cli


class FlagsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("negative_warmup", ["--warmup-steps", "-1"], r"warmup_steps=-1 \(--warmup-steps\) is invalid: expected an integer >= 0"),
      ("warmup_too_long", ["--lr-schedule", "cosine", "--steps", "4", "--warmup-steps", "4"], "warmup_steps=4 .* fewer than --steps 4"),
      ("ratio_of_constant", ["--final-lr-ratio", "0.1"], r"final_lr_ratio=0.1 .* only --lr-schedule cosine and linear"),
      ("ratio_above_one", ["--lr-schedule", "linear", "--final-lr-ratio", "2"], r"final_lr_ratio=2.0 .* in \[0, 1\]"),
      ("negative_decay", ["--weight-decay", "-1"], r"weight_decay=-1.0 \(--weight-decay\) is invalid"),
  )  # fmt: skip
  def test_bad_flags(self, argv, message):
    code, out, err = testing.run_capturing(cli.main, ["train", *argv])
    self.assertEqual(code, 2, out + err)
    self.assertRegex(err, f"^linen-moe: error: .*{message}")
    self.assertEqual(err.count("\n"), 1, err)  # one line, before any step

  def test_unknown_schedule(self):
    with self.assertRaises(SystemExit) as caught:  # argparse's choices
      testing.run_capturing(cli.main, ["train", "--lr-schedule", "step"])
    self.assertEqual(caught.exception.code, 2)


if __name__ == "__main__":
  absltest.main()
