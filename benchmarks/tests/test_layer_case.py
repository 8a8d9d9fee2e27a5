"""The programs the benchmarks time do the work their flop counts claim."""

from absl.testing import absltest
import numpy as np

from common import layer_case
from common import timing


def _dots(hlo_text: str) -> int:
  """Matmuls of a compiled program, inside fusions or not."""
  return sum(" dot(" in line for line in hlo_text.splitlines())


class RooflineStepTest(absltest.TestCase):

  def test_runs_all_three_matmuls(self):
    # Its GFLOP/s count 3 matmuls; a loss whose cotangent is a constant
    # lets XLA drop the forward one.
    step, args = timing.roofline_step((64, 32, 16))
    self.assertEqual(_dots(step.lower(*args).compile().as_text()), 3)

  def test_gradients_match_numpy(self):
    step, (x, w) = timing.roofline_step((64, 32, 16))
    dx, dw = step(x, w)
    xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = xn @ wn  # d(0.5 |y|^2)/dy = y
    np.testing.assert_allclose(dx, y @ wn.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dw, xn.T @ y, rtol=1e-4, atol=1e-3)


class CaseStepTest(absltest.TestCase):

  def test_differentiates_the_layer_input(self):
    # A layer inside a model needs its input's gradient; without it XLA
    # drops the input-gradient matmuls the useful flops count.
    compiled, args, _ = layer_case.compiled_step(
        layer_case.Case("tiny", "sparse")
    )
    grads = compiled(*args)
    self.assertLen(grads, 3)
    x = args[2]
    self.assertEqual(grads[2].shape, x.shape)
    self.assertGreater(float(np.abs(np.asarray(grads[2])).sum()), 0.0)


if __name__ == "__main__":
  absltest.main()
