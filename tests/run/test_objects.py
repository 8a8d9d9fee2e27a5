"""`training.RunOptions` takes objects: a `ModelConfig`, a `Mesh`, an optax
optimizer, tuples; the command line parses its strings into the same
objects, and its errors name the flags where the library's name the fields
(issue 64, item 1)."""

import os
import warnings

from absl.testing import absltest

from linen_moe import load_model_config
from linen_moe import sharding
from linen_moe import training
from linen_moe._src.run import loop
from linen_moe._src.testing import helpers
from tests import cli_helpers

STEPS = 3
SHAPE = dict(steps=STEPS, batch_size=2, seq_len=8)


# An own optimizer's learning rate is not known to the run.
_LEFT_OUT = ("learning_rate", "recipe")


class ObjectsTest(absltest.TestCase):

  def test_objects_train_as_the_command_lines_strings(self):
    python_dir, cli_dir = helpers.tempdir(self), helpers.tempdir(self)
    result = training.run(
        training.RunOptions(
            config=load_model_config("tiny_mixtral").replace(num_layers=1),
            mesh=sharding.make_mesh("data=1"),
            optimizer=training.default_optimizer(3e-3),
            lora_rank=2,
            lora_targets=("experts", "attention"),
            checkpoint_dir=python_dir,
            progress=False,
            **SHAPE,
        ),
        log=lambda _: None,
    )
    status, _, err = cli_helpers.cli(
        "train",
        "--set",
        "num_layers=1",
        "--mesh",
        "data=1",
        "--learning-rate",
        "3e-3",
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "0",
        "--lora-rank",
        "2",
        "--lora-targets",
        "experts,attention",
        "--no-progress",
        "--checkpoint-dir",
        cli_dir,
        *(f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()),
    )
    self.assertEqual(status, 0, err)
    rows = helpers.run_metrics(python_dir, _LEFT_OUT)
    self.assertEqual([r["step"] for r in rows], [1, 2, 3])
    self.assertEqual(rows, helpers.run_metrics(cli_dir, _LEFT_OUT))
    self.assertEqual([r["cross_entropy"] for r in rows], result.losses)
    self.assertLess(result.losses[-1], result.losses[0])  # it trains

  def test_the_command_line_parses_into_objects(self):
    err = cli_helpers.cli_error(
        "train",
        "--profile-steps",
        "2:9",
        "--steps",
        "3",
        "--checkpoint-dir",
        helpers.tempdir(self),
    )
    self.assertEqual(
        err,
        "linen-moe: error: profile_steps=(2, 9) (--profile-steps) is invalid:"
        " the last step traced must be at most --steps 3.\n",
    )
    err = cli_helpers.cli_error("train", "--lora-targets", "experts, mlp")
    self.assertIn("lora_targets=('experts', 'mlp') (--lora-targets)", err)

  def test_objects_of_the_wrong_kind(self):
    for fields, message in (
        (dict(config=3), r"^config=3 is invalid: expected a ModelConfig"),
        (dict(mesh=[1, 2]), r"^mesh=\[1, 2\] is invalid: expected a jax"),
        (dict(optimizer="adam"), r"^optimizer='adam' is invalid: expected"),
        (
            dict(lora_rank=2, lora_targets=["experts", 1]),
            r"^lora_targets=.* is invalid: expected a tuple of str",
        ),
        (dict(profile_steps=(1.0, 2)), r"^profile_steps=.* tuple of int"),
    ):
      with self.subTest(**{k: str(v) for k, v in fields.items()}):
        with self.assertRaisesRegex(TypeError, message):
          training.RunOptions(**fields)

  def test_an_own_optimizer_leaves_the_recipes_rates_unset(self):
    own = training.default_optimizer(1e-3)
    with self.assertRaisesRegex(
        ValueError,
        r"^optimizer=.* is invalid: .*`learning_rate`, `weight_decay` would "
        "be ignored",
    ):
      training.RunOptions(optimizer=own, learning_rate=1e-3, weight_decay=0.1)
    opts = training.RunOptions(optimizer=own)
    self.assertIs(opts.optimizer, own)

  def test_no_field_names_a_flag_and_the_command_adds_it(self):
    with self.assertRaises(ValueError) as caught:
      training.RunOptions(save_every=2)
    text = str(caught.exception)
    self.assertEqual(
        text, "save_every=2 is invalid: it needs a `checkpoint_dir` to save to."
    )
    err = cli_helpers.cli_error("train", "--save-every", "2")
    self.assertEqual(
        err,
        "linen-moe: error: save_every=2 (--save-every) is invalid: it needs a "
        "--checkpoint-dir to save to.\n",
    )

  def test_the_run_package_names_no_flag(self):
    folder = os.path.dirname(os.path.abspath(loop.__file__))
    named = [
        f"{name}:{number}: {line.strip()}"
        for name in sorted(os.listdir(folder))
        if name.endswith(".py")
        for number, line in enumerate(
            open(os.path.join(folder, name), encoding="utf-8"), 1
        )
        if "--" in line
    ]
    self.assertEqual(named, [])

  def test_the_old_strings_still_work_with_a_warning(self):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      opts = training.RunOptions(
          lora_rank=2,
          lora_targets="experts,attention",
          profile_steps="1:2",
          checkpoint_dir=helpers.tempdir(self),
          steps=3,
      )
    self.assertEqual(opts.lora_targets, ("experts", "attention"))
    self.assertEqual(opts.profile_steps, (1, 2))
    self.assertLen(
        [w for w in caught if issubclass(w.category, DeprecationWarning)], 2
    )


if __name__ == "__main__":
  absltest.main()
