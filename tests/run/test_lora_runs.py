"""A run with adapters (`training.run` with `lora_rank`): its LoRA fields
become the model config's, and a QLoRA run on a Hugging Face base with
chat data learns and resumes bit for bit (slow). Its export:
test_cli_lora.py; the adapters themselves: tests/training/."""

from __future__ import annotations

import os
import shutil

from absl.testing import absltest

from linen_moe import training
from linen_moe._src.testing import helpers
from linen_moe.testing import slow
from tests import lora_runs


class LoRAOptionsTest(absltest.TestCase):

  def test_fields_become_config_overrides(self):
    opts = training.RunOptions(
        lora_rank=16,
        lora_alpha=32.0,
        lora_targets=("experts", "attention"),
        frozen_base_serving=True,
        overrides={"quantization": "int8"},
    )
    self.assertEqual(
        opts.overrides,
        {
            "quantization": "int8",
            "lora_rank": 16,
            "lora_alpha": 32.0,
            "lora_targets": ("experts", "attention"),
            "lora_dropout": 0.0,
            "serving": True,
        },
    )


@slow
class QLoRAResumeTest(absltest.TestCase):
  """`whole` trains 4 steps; `resumed`, a copy of it put back at step 2
  (`resume_step=2`), trains steps 3 and 4 again."""

  def test_resume_is_exact(self):
    tmp = helpers.tempdir(self)
    base, chats = lora_runs.write_inputs(tmp)
    whole = os.path.join(tmp, "whole")
    result = training.run(
        lora_runs.options(base, chats, whole), log=lambda _: None
    )
    rows = helpers.run_metrics(whole)
    self.assertLess(rows[-1]["loss"], rows[0]["loss"])
    self.assertEqual(result.losses, [m["cross_entropy"] for m in rows])
    resumed = os.path.join(tmp, "resumed")
    shutil.copytree(whole, resumed)
    again = training.run(
        lora_runs.options(base, chats, resumed, resume_step=2),
        log=lambda _: None,
    )
    self.assertEqual(again.start_step, 2)
    self.assertEqual(helpers.run_metrics(resumed), rows)
    self.assertEqual(again.losses, result.losses[2:])


if __name__ == "__main__":
  absltest.main()
