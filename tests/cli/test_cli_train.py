"""`linen-moe train`: its flags, its one-line errors (exit status 2, no
traceback, checked before any work; 1 for a run that stopped), and the
summary line it prints.

The run it drives is tested through `linen_moe.training.run` in tests/run/
(skipped steps and bad batches: test_skipped_steps.py; a mesh:
test_mesh_runs.py; the options' checks: test_option_checks.py).
"""

import math
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import linen_moe
from linen_moe import training
from linen_moe._src.testing import helpers
from linen_moe_cli import main as cli
from linen_moe_cli import model_args
from linen_moe_cli.commands import train as train_command
from tests import cli_helpers

_cli = cli_helpers.cli


class TrainOptionsTest(parameterized.TestCase):

  @parameterized.parameters(
      (["--steps", "0"], r"steps=0 \(--steps\) is invalid: .*integer >= 1"),
      (["--batch-size", "0"], r"batch_size=0 .*integer >= 1"),
      (["--seq-len", "1"], r"seq_len=1 \(--seq-len\) .*integer >= 2"),
      (["--learning-rate", "0"], r"learning_rate=0.0 .*finite number > 0"),
      (["--learning-rate=-1e-3"], r"learning_rate=-0.001 .*> 0"),
      (["--learning-rate", "nan"], r"learning_rate=nan .*finite number > 0"),
      (["--grad-accum", "0"], r"grad_accum=0 .*integer >= 1"),
      (
          ["--max-consecutive-skips", "0"],
          r"max_consecutive_skips=0 \(--max-consecutive-skips\) .*>= 1",
      ),
      (
          ["--batch-size", "4", "--grad-accum", "3"],
          r"grad_accum=3 .*divisor of batch_size=4 \(\[1, 2, 4\]\)",
      ),
      (
          ["--profile-steps", "3-4"],
          r"--profile-steps '3-4' is invalid: expected A:B",
      ),
      (
          ["--profile-steps", "2:3"],
          r"profile_steps=\(2, 3\) \(--profile-steps\) .*give a "
          "--checkpoint-dir",
      ),
  )
  def test_bad_flag_is_one_line_before_any_work(self, argv, message):
    with mock.patch.object(training, "run") as train:
      status, _, err = _cli("train", *argv)
    train.assert_not_called()  # checked before the job (and jax) starts
    self.assertEqual(status, 2)
    self.assertRegex(err, "^linen-moe: error: " + message)
    self.assertEqual(err.count("\n"), 1, err)

  def test_missing_module_anywhere_is_one_line(self):
    # A module that is installed nowhere (tokamax, the example this used,
    # is now in the test extra).
    name = "linen_moe_optional_example"
    missing = ModuleNotFoundError(f"No module named {name!r}", name=name)
    with mock.patch.object(train_command, "run", side_effect=missing):
      status, _, err = _cli("train")
    self.assertEqual(status, 2)
    self.assertEqual(
        err,
        f"linen-moe: error: {name} is not installed, so this command stops; "
        f"install it with pip install {name}.\n",
    )

  def test_bad_mesh(self):
    self.assertEqual(_cli("train", "--mesh", "data=3,expert=7")[0], 2)

  def test_frontend_and_grad_accum_flags(self):
    args = cli.build_parser().parse_args(
        ["train", "--frontend", "nnx", "--grad-accum", "4"]
    )
    self.assertEqual((args.frontend, args.grad_accum), ("nnx", 4))
    with self.assertRaises(SystemExit):
      cli.build_parser().parse_args(["train", "--frontend", "haiku"])

  def test_set_overrides(self):
    args = cli.build_parser().parse_args([
        "train",
        "--set",
        "routed_bias=false",
        "--set",
        "routed_bias_update_rate=0",
        "--set",
        "drop_policy=probability",
        "--quantization",
        "int8",
    ])
    self.assertEqual(
        model_args.model_overrides(args),
        dict(
            routed_bias=False,
            routed_bias_update_rate=0,
            drop_policy="probability",
            quantization="int8",
        ),
    )
    with self.assertRaisesRegex(ValueError, "'routed_bias': expected FIELD"):
      model_args.parse_set(["routed_bias"])
    self.assertEqual(cli.main(["train", "--set", "num_routing_groups=3"]), 2)

  def test_set_reads_exponents_as_numbers(self):
    # train --help's own example: PyYAML (YAML 1.1) reads 1e-3 as a string.
    overrides = model_args.parse_set([
        "router_z_loss_weight=1e-3",
        "router_jitter=.5E1",
        "aux_loss_weight=-2e+2",
        "remat=full",
        'drop_policy="1e-3"',  # quoted: a string
    ])
    self.assertEqual(
        overrides,
        dict(
            router_z_loss_weight=0.001,
            router_jitter=5.0,
            aux_loss_weight=-200.0,
            remat="full",
            drop_policy="1e-3",
        ),
    )
    help_text = " ".join(cli_helpers.cli_output("train", "--help").split())
    self.assertIn("--set router_z_loss_weight=1e-3", help_text)
    cfg = linen_moe.load_model_config(
        "tiny_deepseek_v3",
        **model_args.parse_set(["router_z_loss_weight=1e-3"]),
    )
    self.assertEqual(cfg.moe.router_z_loss_weight, 1e-3)

  def test_bad_input_leaves_no_run_directory(self):
    runs = helpers.tempdir(self)
    with mock.patch.dict(os.environ, {"LINEN_MOE_RUNS_DIR": runs}):
      status, out, err = _cli("train", "--set", "router_jitter=often")
    self.assertEqual(status, 2, err)
    self.assertIn(f"run directory: {runs}/tiny_mixtral-", out)
    self.assertIn("router_jitter='often'", err)
    self.assertEqual(os.listdir(runs), [])

  def test_remat_flag_sets_the_config_field(self):
    args = cli.build_parser().parse_args(["train", "--remat", "save_experts"])
    self.assertEqual(
        model_args.model_overrides(args), {"remat": "save_experts"}
    )
    with mock.patch.object(training, "run") as train:
      status, _, err = _cli("train", "--remat", "dots")
    train.assert_not_called()
    self.assertEqual(status, 2)
    self.assertIn(  # argparse's choices
        "error: argument --remat: invalid choice: 'dots' (choose from", err
    )


class ResultLineTest(absltest.TestCase):

  def test_load_ratio_of_the_worst_layer(self):
    result = training.RunResult(
        losses=[1.0],
        best_loss=1.0,
        expert_load=np.array([[0.25, 0.25, 0.25, 0.25], [0.4, 0.2, 0.2, 0.2]]),
    )
    self.assertAlmostEqual(result.load_ratio, 2.0)
    with mock.patch.object(training, "run", return_value=result):
      status, out, _ = _cli("train", "--steps=1")
    self.assertEqual(status, 0)
    self.assertIn("expert load max/min: 2.00  wall: ", out)

  def test_reports_skipped_steps(self):
    result = training.RunResult([math.nan, 2.0, 1.0], 1.5, skipped_steps=1)
    with mock.patch.object(training, "run", return_value=result):
      status, out, _ = _cli("train", "--steps=3")
    self.assertEqual(status, 0)
    self.assertRegex(
        out,
        r"(?m)^steps: 1-3  first loss: 2.0000  final loss: 1.5000 \(mean of "
        r"the last 3 steps\)  best achievable: "
        r"1.5000  skipped steps: 1  wall: ",
    )


class StoppedRunTest(absltest.TestCase):

  def test_a_run_that_stops_is_one_line_naming_the_flags(self):
    # The run's message names its fields (tests/run/test_skipped_steps.py
    # checks the real one); the command names its flags, exit status 1.
    stopped = training.RunStopped(
        "stopped at step 4 of 6: the last 3 steps (2 to 4) were all skipped "
        "for a non-finite loss or gradient (`max_consecutive_skips` 3; 3 "
        "skipped in all). The run is not recovering: lower `learning_rate`, "
        "or check the data."
    )
    with mock.patch.object(training, "run", side_effect=stopped):
      status, _, err = _cli("train", "--max-consecutive-skips=3")
    self.assertEqual(status, 1)
    self.assertEqual(
        err,
        "linen-moe: error: stopped at step 4 of 6: the last 3 steps (2 to 4) "
        "were all skipped for a non-finite loss or gradient "
        "(--max-consecutive-skips 3; 3 skipped in all). The run is not "
        "recovering: lower --learning-rate, or check the data.\n",
    )


if __name__ == "__main__":
  absltest.main()
