"""`linen-moe export`: a training checkpoint to serving variables on disk.
The library's `checkpoint.export`: test_checkpoint.py."""

import os

from absl.testing import absltest
import jax.numpy as jnp

from linen_moe import checkpoint
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe_cli import main as cli
from tests.checkpoint.test_checkpoint import CheckpointTestBase


class ExportCommandTest(CheckpointTestBase):

  def test_export_command(self):
    out = os.path.join(self.tmp, "cli_export")
    code = cli.main([
        "export",
        "--checkpoint-dir",
        self.saved_dir,
        "--out",
        out,
        "--dtype",
        "bfloat16",
    ])
    self.assertEqual(code, 0)
    exported, _ = checkpoint.load_export(out)
    self.assertEqual(
        exported["params"]["embed"]["embedding"].dtype, jnp.bfloat16
    )
    self.assertEqual(
        exported[OVERWRITE_WITH_GRADIENT]["layers"]["moe"]["wo_dot"][
            "kernel_scale"
        ].dtype,
        jnp.float32,
    )


if __name__ == "__main__":
  absltest.main()
