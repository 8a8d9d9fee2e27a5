"""`training.RunOptions` checks its fields at construction: a bad value is
a `ValueError` naming the field and the value (the command line adds its
flag to the same message: tests/cli/test_cli_train.py)."""

from absl.testing import absltest

from linen_moe.training import RunOptions


class OptionChecksTest(absltest.TestCase):

  def test_a_bad_field_is_named(self):
    with self.assertRaisesRegex(ValueError, r"^seq_len=1 is invalid"):
      RunOptions("tiny_mixtral", {}, steps=1, seq_len=1)
    with self.assertRaisesRegex(ValueError, r"steps=True"):
      RunOptions(steps=True, batch_size=1, seq_len=2)


if __name__ == "__main__":
  absltest.main()
