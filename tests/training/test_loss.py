"""The next-token cross-entropy and its gradient against NumPy."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe.frontend import loss_weights
from linen_moe.training import cross_entropy


def _numpy_loss_and_grad(logits, tokens, mask=None):
  """Mean of -log softmax(logits[b, s])[tokens[b, s + 1]] over the positions
  with a real next target (the ids at s and s + 1 both True in `mask`; every
  one of the B * (S - 1) without a mask), and its gradient, float64."""
  x = np.asarray(logits, np.float64)
  b, s, _ = x.shape
  mask = np.ones((b, s), bool) if mask is None else np.asarray(mask)
  loss, grad, n = 0.0, np.zeros_like(x), 0
  for i in range(b):
    for j in range(s - 1):
      if not (mask[i, j] and mask[i, j + 1]):
        continue
      row = x[i, j] - x[i, j].max()
      p = np.exp(row) / np.exp(row).sum()
      target = int(tokens[i, j + 1])
      loss -= np.log(p[target])
      grad[i, j] = p
      grad[i, j, target] -= 1.0
      n += 1
  return loss / n, grad / n


class CrossEntropyTest(parameterized.TestCase):

  @parameterized.parameters(
      (jnp.float32, 1e-6, 1e-7), (jnp.bfloat16, 1e-6, 2e-4)
  )
  def test_matches_numpy(self, dtype, loss_rtol, grad_atol):
    keys = jax.random.split(jax.random.key(0), 2)
    logits = (3.0 * jax.random.normal(keys[0], (3, 7, 11))).astype(dtype)
    tokens = jax.random.randint(keys[1], (3, 7), 0, 11)
    loss, grad = jax.jit(jax.value_and_grad(cross_entropy))(logits, tokens)
    want_loss, want_grad = _numpy_loss_and_grad(logits, tokens)
    self.assertEqual(loss.dtype, jnp.float32)
    self.assertEqual(grad.dtype, dtype)
    np.testing.assert_allclose(loss, want_loss, rtol=loss_rtol)
    np.testing.assert_allclose(
        np.asarray(grad, np.float64), want_grad, atol=grad_atol
    )
    # The last position predicts nothing: no gradient reaches it.
    self.assertEqual(float(jnp.max(jnp.abs(grad[:, -1]))), 0.0)

  def test_weighted_is_the_mean_over_real_targets(self):
    """With `loss_weights` of a mask, the loss and its gradient are those of
    the real targets alone, split over two microbatches or not."""
    keys = jax.random.split(jax.random.key(1), 2)
    logits = 3.0 * jax.random.normal(keys[0], (4, 6, 11))
    tokens = jax.random.randint(keys[1], (4, 6), 0, 11)
    mask = np.arange(6)[None, :] < np.array([6, 3, 2, 1])[:, None]
    mask[1, 4:] = True  # real ids after padding: a target only at 5
    weights = loss_weights(mask)  # 5 + 3 + 1 + 0 = 9 real targets
    loss, grad = jax.jit(jax.value_and_grad(cross_entropy))(
        logits, tokens, weights
    )
    want_loss, want_grad = _numpy_loss_and_grad(logits, tokens, mask)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grad, np.float64), want_grad, atol=1e-7
    )
    # Gradient accumulation averages the two halves' weighted means.
    halves = [
        cross_entropy(logits[h], tokens[h], weights[h])
        for h in (slice(0, 2), slice(2, 4))
    ]
    np.testing.assert_allclose(np.mean(halves), want_loss, rtol=1e-6)

  def test_needs_two_tokens(self):
    with self.assertRaisesRegex(ValueError, r"at least 2 tokens.*\(3, 1\)"):
      cross_entropy(jnp.zeros((3, 1, 5)), jnp.zeros((3, 1), jnp.int32))


if __name__ == "__main__":
  absltest.main()
