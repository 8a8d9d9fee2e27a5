"""`linen-moe generate`'s flags: a model to decode, `--serve` (the weights'
storage) beside `--quantization` (the float weights' contractions). Runs
from checkpoints: test_cli_hf.py; decoding itself: test_decoding.py; timing
float against serving weights: benchmarks/serving/bench_serving.py."""

import contextlib
import io
import pathlib

from absl.testing import absltest

from linen_moe import testing
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe_cli import prompt_job
from linen_moe_cli.main import build_parser
from linen_moe_cli.main import main

MIXTRAL = pathlib.Path(__file__).parent / "fixtures" / "hf" / "mixtral_gqa_swa"


def _error(*argv: str) -> str:
  status, _, err = testing.run_capturing(main, ["generate", *argv])
  if status != 2:
    raise AssertionError(f"generate {' '.join(argv)} exited {status}")
  return err


class GenerateFlagsTest(absltest.TestCase):

  def test_serve_offers_none_and_the_modes_that_store_weights(self):
    parser = build_parser()
    args = parser.parse_args(["generate", "--hf-dir", "d"])
    self.assertEqual(args.serve, "none")  # float weights
    self.assertIsNone(args.quantization)  # no per-command default
    for mode in ("none", "int8", "fp8", "nanoo_fp8"):
      args = parser.parse_args(["generate", "--hf-dir", "d", "--serve", mode])
      self.assertEqual(args.serve, mode)
    with (
        self.assertRaises(SystemExit),
        contextlib.redirect_stderr(io.StringIO()),
    ):
      parser.parse_args(["generate", "--hf-dir", "d", "--serve", "bogus"])

  def test_a_model_is_needed(self):
    err = _error("--prompt-ids", "1,2")
    self.assertIn("needs a model: --hf-dir DIR or --checkpoint-dir DIR", err)
    self.assertIn("bench_serving.py", err)

  def test_quantization_other_than_the_served_mode_is_refused(self):
    d = str(MIXTRAL)
    for argv in (
        ["--serve", "int8", "--quantization", "fp8"],
        ["--serve", "fp8", "--quantization", "none"],
    ):
      with self.subTest(argv=argv):
        err = _error("--hf-dir", d, "--prompt-ids", "1", *argv)
        self.assertRegex(err, r"--quantization \w+ with --serve \w+")


class GenerateModelTest(absltest.TestCase):
  """What each choice loads: the config's mode, serving flag and state."""

  def test_serve_and_quantization_pick_the_model(self):
    for serve, quantization, mode, serving, fp8_state in (
        ("none", None, "none", False, False),
        ("none", "fp8", "fp8", False, True),  # float weights, fp8 dots
        ("int8", None, "int8", True, False),
        ("fp8", "fp8", "fp8", True, False),  # scales in the stored kernels
    ):
      with self.subTest(serve=serve, quantization=quantization):
        config, variables = prompt_job.load_model(
            str(MIXTRAL), None, serve, quantization
        )
        self.assertEqual(config.moe.quantization, mode)
        self.assertEqual(config.moe.serving, serving)
        self.assertEqual(OVERWRITE_WITH_GRADIENT in variables, fp8_state)

  def test_float_weights_in_fp8_contractions(self):
    status, out, err = testing.run_capturing(
        main,
        ["generate", "--hf-dir", str(MIXTRAL), "--prompt-ids", "1,2,3"]
        + ["--new-tokens", "2", "--quantization", "fp8"],
    )
    self.assertEqual(status, 0, err)
    self.assertIn("weights: float (in fp8's contractions)", out)
    self.assertRegex(out, r"new ids: \[\d+, \d+\]")


if __name__ == "__main__":
  absltest.main()
