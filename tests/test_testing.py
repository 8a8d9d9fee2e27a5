"""`linen_moe.testing`'s own helpers: the slow mark in every position it
promises (an absl upgrade that changed how parameterized copies methods
would otherwise put slow cases back into the default run, unseen)."""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st
import numpy as np

from linen_moe import testing
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe._src.testing.marks import is_heavy
from linen_moe._src.testing.marks import is_slow


class SlowTest(absltest.TestCase):

  def test_marks_every_generated_case(self):
    class Cases(parameterized.TestCase):

      @testing.slow
      @parameterized.parameters(1, 2)
      def test_above(self, x):
        del x

      @parameterized.product(x=(1, 2), y=(3,))
      @testing.slow
      def test_below(self, x, y):
        del x, y

      @parameterized.named_parameters(("a", 1))
      @testing.slow
      def test_named(self, x):
        del x

      @testing.slow
      @given(st.integers())
      def test_property(self, x):
        del x

      def test_plain(self):
        pass

    slow = sorted(
        name
        for name in dir(Cases)
        if name.startswith("test") and is_slow(getattr(Cases, name))
    )
    self.assertEqual(
        slow,
        ["test_above0", "test_above1", "test_below0", "test_below1"]
        + ["test_named_a", "test_property"],
    )
    self.assertFalse(is_slow(Cases.test_plain))

  def test_marks_a_class_and_rejects_the_rest(self):
    @testing.slow
    class Slow(absltest.TestCase):
      pass

    self.assertTrue(is_slow(Slow))
    with self.assertRaisesRegex(TypeError, "slow marks a test class or method"):
      testing.slow(3)


class HeavyTest(absltest.TestCase):

  def test_marks_generated_cases_apart_from_slow(self):
    class Cases(parameterized.TestCase):

      @heavy
      @parameterized.parameters(1, 2)
      def test_above(self, x):
        del x

      @testing.slow
      def test_slow(self):
        pass

    self.assertTrue(is_heavy(Cases.test_above0) and is_heavy(Cases.test_above1))
    self.assertFalse(is_slow(Cases.test_above0))
    self.assertFalse(is_heavy(Cases.test_slow))

    @heavy
    class Whole(absltest.TestCase):
      pass

    self.assertTrue(is_heavy(Whole))
    with self.assertRaisesRegex(
        TypeError, "heavy marks a test class or method"
    ):
      heavy("test_x")


class MeasuresTest(absltest.TestCase):

  def test_rel_err_and_max_abs_diff(self):
    self.assertAlmostEqual(helpers.rel_err([3.0, 4.0], [3.0, 5.0]), 1 / 34**0.5)
    a = {"w": np.array([1.0, 2.0]), "b": np.array(3.0)}
    b = {"w": np.array([1.0, 2.5]), "b": np.array(2.0)}
    self.assertEqual(helpers.max_abs_diff(a, b), 1.0)
    self.assertEqual(helpers.max_abs_diff({}, {}), 0.0)


class RunFilesTest(helpers.TempDirMixin, absltest.TestCase):

  def test_tempdir_is_removed_when_the_test_ends(self):
    class Inner(helpers.TempDirMixin, absltest.TestCase):

      def runTest(self):
        Inner.made = self.tempdir()
        assert os.path.isdir(Inner.made)

    Inner().run()
    self.assertFalse(os.path.exists(Inner.made))

  def test_run_metrics_leaves_out_the_step_times(self):
    directory = self.tempdir()
    rows = [
        {
            "step": 1,
            "loss": 2.5,
            "tokens_per_s": 9.0,
            "mfu": 0.1,
            "recipe": {"steps": 4, "lr": 0.1},
        },
        {"step": 2, "loss": 2.0, "model_tflops_per_s": 1.0, "lr": 0.1},
    ]
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    self.assertEqual(
        helpers.run_metrics(directory),
        [
            {"step": 1, "loss": 2.5, "recipe": {"steps": 4, "lr": 0.1}},
            {"step": 2, "loss": 2.0, "lr": 0.1},
        ],
    )
    self.assertEqual(
        helpers.run_metrics(directory, ("lr", "recipe")),
        [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}],
    )
    self.assertEqual(
        helpers.run_metrics(directory, recipe_steps=False)[0]["recipe"],
        {"lr": 0.1},
    )


if __name__ == "__main__":
  absltest.main()
