"""`linen_moe.training.run`: a whole run from Python, with the same effect as
`linen-moe train` (the command calls it), and its bad input."""

import os

from absl.testing import absltest

from linen_moe import training
from linen_moe._src.testing import helpers
from tests import cli_helpers

ARGS = dict(steps=3, batch_size=4, seq_len=8, save_every=2)


class RunTest(absltest.TestCase):

  def test_python_run_equals_the_command(self):
    python_dir, cli_dir = helpers.tempdir(self), helpers.tempdir(self)
    result = training.run(
        training.RunOptions(checkpoint_dir=python_dir, progress=False, **ARGS),
        log=lambda _: None,
    )
    status, out, err = cli_helpers.cli(
        "train",
        "--no-progress",
        "--checkpoint-dir",
        cli_dir,
        *(f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()),
    )
    self.assertEqual(status, 0, err)
    self.assertIn(f"final loss: {result.final_loss:.4f}", out)
    self.assertEqual(
        helpers.run_metrics(python_dir), helpers.run_metrics(cli_dir)
    )
    self.assertEqual(
        [r["cross_entropy"] for r in helpers.run_metrics(python_dir)],
        result.losses,
    )
    self.assertEqual(
        sorted(os.listdir(python_dir)), sorted(os.listdir(cli_dir))
    )

  def test_bad_input(self):
    with self.assertRaisesRegex(TypeError, "opts must be a RunOptions"):
      training.run({"steps": 3})
    with self.assertRaisesRegex(ValueError, r"^steps=0 is invalid"):
      training.RunOptions(steps=0)


if __name__ == "__main__":
  absltest.main()
