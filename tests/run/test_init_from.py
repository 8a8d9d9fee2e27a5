"""How a run starts: the recipe its start picks (scratch, fine-tune, LoRA)
and what the user sets over it, and a new run from another run's weights
(`init_from`): the weights as loaded, a fresh optimizer from step 0, the
fine-tune recipe recorded, and a resume with another optimizer refused.
The command's banner, lines and default directory:
tests/cli/test_cli_fine_tune.py."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import tempfile

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe import load_model_config
from linen_moe import training
from linen_moe._src.run import recipes
from linen_moe._src.testing import helpers
from linen_moe.training import RunOptions

QWEN = str(
    pathlib.Path(__file__).parents[1] / "fixtures/hf/qwen3_moe_dense0_norm"
)
SHAPE = dict(batch_size=2, seq_len=8, progress=False)


class RecipeTest(absltest.TestCase):
  """Which defaults a run gets, before jax."""

  def test_the_start_picks_the_recipe(self):
    scratch = RunOptions()
    self.assertEqual(scratch.recipe, recipes.SCRATCH)
    self.assertEqual(
        (scratch.steps, scratch.batch_size, scratch.seq_len),
        (200, 16, 32),
    )
    self.assertEqual(
        (scratch.learning_rate, scratch.lr_schedule), (1e-2, "constant")
    )
    self.assertEqual(scratch.warmup_steps, 0)
    tuned = RunOptions(init_from_hf=QWEN)
    self.assertEqual(tuned.recipe, recipes.FINE_TUNE)
    self.assertEqual(
        (
            tuned.learning_rate,
            tuned.lr_schedule,
            tuned.seq_len,
            tuned.batch_size,
        ),
        (2e-5, "cosine", 1024, 8),
    )
    self.assertEqual(tuned.warmup_steps, 30)  # 3 % of 1000
    lora = RunOptions(init_from_hf=QWEN, lora_rank=8)
    self.assertEqual((lora.recipe.name, lora.learning_rate), ("lora", 2e-4))

  def test_what_the_user_sets_wins(self):
    opts = RunOptions(
        init_from_hf=QWEN, steps=200, learning_rate=1e-4, lr_schedule="linear"
    )
    self.assertEqual(
        (opts.learning_rate, opts.lr_schedule, opts.warmup_steps),
        (1e-4, "linear", 6),  # the warmup follows the steps given
    )
    opts = RunOptions(init_from_hf=QWEN, steps=2, warmup_steps=1)
    self.assertEqual(opts.warmup_steps, 1)

  def test_init_from_a_directory_without_a_checkpoint(self):
    empty = helpers.tempdir(self)
    with self.assertRaisesRegex(
        ValueError, r"^init_from=.* is invalid: .* it holds no checkpoint"
    ):
      RunOptions(init_from=empty)
    with self.assertRaisesRegex(ValueError, "it does not exist"):
      RunOptions(init_from=os.path.join(empty, "nowhere"))


class InitFromTest(absltest.TestCase):
  """One tiny run, then a new run from it."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.source = tempfile.mkdtemp(prefix="linen_moe_source-")
    cls.addClassCleanup(shutil.rmtree, cls.source, ignore_errors=True)
    training.run(
        RunOptions(
            config=load_model_config("tiny_mixtral").replace(num_layers=1),
            steps=5,
            log_every=2,
            checkpoint_dir=cls.source,
            **SHAPE,
        ),
        log=lambda _: None,
    )

  def test_the_start_records_its_recipe_once(self):
    rows = helpers.read_jsonl(os.path.join(self.source, "metrics.jsonl"))
    self.assertEqual([r["step"] for r in rows], [1, 2, 3, 4, 5])
    self.assertEqual(rows[0]["recipe"]["name"], "scratch")
    self.assertNotIn("recipe", rows[1])

  def test_init_from_a_run(self):
    run = os.path.join(helpers.tempdir(self), "tuned")
    # Another optimizer than the source's (constant 1e-2): a new run, not a
    # resume. A rate of 1e-30 leaves the weights as loaded.
    opts = RunOptions(
        init_from=self.source,
        checkpoint_dir=run,
        steps=1,
        learning_rate=1e-30,
        **SHAPE,
    )
    self.assertEqual(opts.recipe, recipes.FINE_TUNE)
    lines = []
    result = training.run(opts, log=lines.append)
    self.assertEqual((result.start_step, len(result.losses)), (0, 1))
    self.assertIn(  # the banner's first line
        f"linen-moe train: from {self.source}, fine-tune recipe", lines
    )
    _, loaded, _ = checkpoint.read_variables(self.source)
    _, tuned, step = checkpoint.read_variables(run)
    self.assertEqual(step, 1)  # a new run counts from 0
    loaded, tuned = map(helpers.flat_numpy, (loaded["params"], tuned["params"]))
    self.assertEqual(loaded.keys(), tuned.keys())
    for path, value in loaded.items():
      np.testing.assert_allclose(tuned[path], value, rtol=1e-6, err_msg=path)
    first = helpers.read_jsonl(os.path.join(run, "metrics.jsonl"))[0]
    self.assertEqual(first["recipe"]["name"], "fine-tune")
    self.assertEqual(first["recipe"]["learning_rate"], 1e-30)
    # Resuming the source with this rate is refused, and says what to do.
    with self.assertRaisesRegex(
        ValueError,
        rf"`init_from` {re.escape(self.source)} and a new `checkpoint_dir`",
    ):
      training.run(
          RunOptions(
              config=load_model_config("tiny_mixtral").replace(num_layers=1),
              checkpoint_dir=self.source,
              steps=6,
              learning_rate=1e-30,
              **SHAPE,
          ),
          log=lambda _: None,
      )


if __name__ == "__main__":
  absltest.main()
