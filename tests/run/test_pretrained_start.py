"""A run from a pretrained start (`init_from_hf`, `init_from`): the
checkpoint is the model, so a config beside it is refused, and the run's
default directory is named after the model trained (issue 62, item 4)."""

import os
import pathlib
import re
from unittest import mock

from absl.testing import absltest

from linen_moe import training
from linen_moe._src.testing import helpers
from tests import cli_helpers

MIXTRAL = (
    pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "mixtral_gqa_swa"
)
SHAPE = ("--batch-size", "2", "--seq-len", "8", "--no-progress")


def _a_run(test: absltest.TestCase, name: str) -> str:
  """An (empty) run directory `name` holding a checkpoint step folder."""
  where = os.path.join(helpers.tempdir(test), name)
  os.makedirs(os.path.join(where, "3"))
  return where


class ConfigBesideACheckpointTest(absltest.TestCase):

  def test_a_config_with_a_pretrained_start_is_refused(self):
    run_dir = _a_run(self, "tiny_mixtral-20261207-120000")
    for start in ({"init_from_hf": str(MIXTRAL)}, {"init_from": run_dir}):
      with self.subTest(**start):
        with self.assertRaisesRegex(
            ValueError,
            r"config='tiny_gpt_oss'.* is invalid: .* is the model .*drop it",
        ):
          training.RunOptions(config="tiny_gpt_oss", **start)
        training.RunOptions(**start)  # no config: the checkpoint's model

  def test_the_command_refuses_it_naming_the_flags(self):
    err = cli_helpers.cli_error(
        "train", "--config", "tiny_gpt_oss", "--init-from-hf", str(MIXTRAL)
    )
    self.assertIn("--config", err)
    self.assertIn("--init-from-hf", err)
    self.assertIn("drop it", err)

  def test_model_name(self):
    run_dir = _a_run(self, "tiny_qwen3_moe-20261207-120000-2")
    for options, name in (
        (training.RunOptions(), "tiny_mixtral"),
        (training.RunOptions(config="tiny_gpt_oss"), "tiny_gpt_oss"),
        (training.RunOptions(init_from_hf=str(MIXTRAL)), "mixtral_gqa_swa"),
        (training.RunOptions(init_from=run_dir), "tiny_qwen3_moe"),
    ):
      self.assertEqual(options.model_name, name)

  def test_default_run_directory_is_named_after_the_model(self):
    runs = helpers.tempdir(self)
    with mock.patch.dict(os.environ, {"LINEN_MOE_RUNS_DIR": runs}):
      status, out, err = cli_helpers.cli(
          "train", "--init-from-hf", str(MIXTRAL), "--steps", "1", *SHAPE
      )
    self.assertEqual(status, 0, err)
    where = re.search(r"^run directory: (\S+) ", out, re.M)[1]
    self.assertRegex(os.path.basename(where), r"^mixtral_gqa_swa-\d{8}-\d{6}$")
    self.assertIn("linen-moe train: from ", out)


if __name__ == "__main__":
  absltest.main()
